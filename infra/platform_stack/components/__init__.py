"""The platform stack's layers, one ComponentResource per module."""

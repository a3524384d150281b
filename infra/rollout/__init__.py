"""Changing a running environment: preflight, ordered steps, canary, releases, rollback."""

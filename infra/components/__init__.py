"""One Pulumi ComponentResource per layer of the system, each in a module of its own."""

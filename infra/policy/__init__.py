"""Review rules for `pulumi preview --policy-pack policy` (and `pdctl policy` offline)."""

"""Pure rendering: spec to engine arguments, router and cache configs, manifests on disk."""

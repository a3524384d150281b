"""The per-cluster platform stack: cloud (cluster, buckets, identities, node classes), the
controllers every serving stack relies on (one pinned catalog), and the GPU nodes' layer."""

"""The node store: every tensor once in host memory, its plans, arenas, leases, ingress."""

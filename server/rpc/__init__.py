"""The gRPC edge: the servicer, its checks, interceptors and reflection; no node state."""

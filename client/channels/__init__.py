"""gRPC to the servers: the loop thread, the channels and stubs, the update streams."""

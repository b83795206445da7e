"""weightsync.server."""

"""weightsync.common."""

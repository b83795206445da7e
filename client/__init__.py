"""weightsync.client."""

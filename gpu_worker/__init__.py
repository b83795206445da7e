"""weightsync.gpu_worker."""

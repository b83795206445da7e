"""weightsync.integrations: drop-ins for RL libraries (optional extras; see weightsync.integrations.trl)."""

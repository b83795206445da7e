"""The worker processes: the supervisor and what an update sees of them."""

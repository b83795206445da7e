"""Where a push's bucket bytes go: one sink per transport (base.py says what a sink does)."""

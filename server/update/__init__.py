"""One update, Begin to Committed: the session and its steps."""

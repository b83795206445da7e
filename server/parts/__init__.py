"""The parts' join, before an update exists: the rules and the joins."""

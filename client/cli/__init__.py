"""The `weightsync` command line: info, groups, push, verify, serve, the demo."""

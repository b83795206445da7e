"""What the node tells the world: the published version, watchers, engines."""

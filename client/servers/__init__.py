"""What the SDK knows of each server: one record per server, the rules across them."""

"""What changed since the last commit, and whether patches pay."""

"""One push: its runs (dense and patched), and the plan each run uses."""

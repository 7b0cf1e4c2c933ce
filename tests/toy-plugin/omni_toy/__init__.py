"""A toy model family for Omni's tests: tiny random-weight checkpoints, built offline."""

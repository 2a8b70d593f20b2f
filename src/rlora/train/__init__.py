"""Training recipes (the RL loop) and their plumbing: optimiser, outputs, evaluation."""

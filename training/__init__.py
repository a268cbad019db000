"""Training: state, optimizer, steps, checkpoints, evaluation and the loop."""

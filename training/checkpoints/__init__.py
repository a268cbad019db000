"""Checkpoints: rotation and the best step, reading and verifying, choosing and averaging."""

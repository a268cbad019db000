"""What a run reports: log filtering, scalars to TensorBoard and JSON lines, attention maps."""

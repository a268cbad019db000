"""Tasks the training loop trains through: the protocol (`base`), translation and classification."""

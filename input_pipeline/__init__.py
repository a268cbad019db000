"""Input pipeline: TFDS sources, SentencePiece subwords, length-bucketed batches."""

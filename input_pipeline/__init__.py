"""Input pipeline: datasets prepared as ArrayRecord, SentencePiece subwords, streamed packed rows, length buckets."""

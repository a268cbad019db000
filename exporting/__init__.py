"""Trained translation models written out for other engines: Hugging Face `transformers` and CTranslate2."""

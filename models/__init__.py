"""The Transformer model of "Attention Is All You Need"."""

from models.transformer import Transformer, TransformerConfig

__all__ = ['Transformer', 'TransformerConfig']

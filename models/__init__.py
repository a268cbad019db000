"""The Transformer model of "Attention Is All You Need", and an encoder-only classifier built on its encoder."""

from models.classifier import Classifier, ClassifierConfig
from models.transformer import Transformer, TransformerConfig

__all__ = ['Classifier', 'ClassifierConfig', 'Transformer', 'TransformerConfig']

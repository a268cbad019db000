"""The Transformer model of "Attention Is All You Need", and an encoder-only classifier built on its encoder."""

from models.classifier import Classifier, ClassifierConfig
from models.config import TransformerConfig
from models.packing import Packing
from models.transformer import Transformer

__all__ = ['Classifier', 'ClassifierConfig', 'Packing', 'Transformer', 'TransformerConfig']

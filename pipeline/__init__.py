"""Token Pooling in Vision Transformers: a reproduction pipeline."""

__version__ = "0.1.0"

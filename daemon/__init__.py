"""escapement: a model-serving daemon that makes GPU inference predictable."""

__version__ = "0.1.0"

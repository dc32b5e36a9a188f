"""escapement: a model-serving daemon that makes GPU inference predictable."""

from daemon import native

__version__ = "0.1.0"

# Before any controller module is imported: compiled where a current build exists (daemon/native.py).
native.select()

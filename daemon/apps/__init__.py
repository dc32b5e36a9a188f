"""Clipper and Velox in escapement: what sits between applications and models (the prediction cache)."""

"""Data sets: the scikit-learn digits, split once with a fixed seed.

The demo models (daemon/demo.py) are trained on its training split, and `train-parity` trains a
parity model on it by default (trainer.load_dataset), so both see the same split.
"""

from __future__ import annotations

import numpy as np

SEED = 0  # the split's seed: the same train/test split everywhere


def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits dataset split 80/20 with a fixed seed: (x_train, y_train, x_test, y_test)."""
    from sklearn.datasets import load_digits  # (sklearn is slow to import: only when asked)

    data = load_digits()
    x = data.data.astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(SEED).permutation(len(x))
    cut = int(0.8 * len(x))
    tr, te = order[:cut], order[cut:]
    return x[tr], y[tr], x[te], y[te]

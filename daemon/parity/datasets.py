"""Data sets a parity model trains on: the scikit-learn digits (split once with a fixed seed), or
an npz file of a user's samples.

The demo models (daemon/demo.py) are trained on the digits' training split, and `train-parity`
trains a parity model on it by default (`load_dataset`), so both see the same split.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from daemon.model import ModelSpec

SEED = 0  # the split's seed: the same train/test split everywhere


@dataclass
class Dataset:
    x_train: np.ndarray
    x_test: np.ndarray
    y_train: np.ndarray | None = None
    y_test: np.ndarray | None = None


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


def load_dataset(spec: ModelSpec, data: str | Path | None, seed: int = 0) -> Dataset:
    """The demo digits (data=None) or an npz file: `x` [+ `y`] split 80/20, or `x_train`/`x_test`."""
    shape = spec.inputs[0].sample_shape
    if data is None:
        xtr, ytr, xte, yte = digits_split()
        if int(np.prod(shape)) != xtr.shape[1]:
            raise ValueError(f"{spec.name} takes {list(shape)} per sample; the digits are 64 values: pass --data")
        return Dataset(xtr.reshape(-1, *shape), xte.reshape(-1, *shape), ytr, yte)
    z = np.load(data)
    if "x_train" in z:
        d = Dataset(z["x_train"], z["x_test"], z.get("y_train"), z.get("y_test"))
    else:
        x = z["x"]
        y = z.get("y")
        order = np.random.default_rng(seed).permutation(len(x))
        cut = int(0.8 * len(x))
        tr, te = order[:cut], order[cut:]
        d = Dataset(x[tr], x[te], y[tr] if y is not None else None, y[te] if y is not None else None)
    for name in ("x_train", "x_test"):
        arr = getattr(d, name)
        if tuple(arr.shape[1:]) != tuple(shape):
            raise ValueError(f"{data}: {name} has samples of shape {list(arr.shape[1:])}, "
                             f"{spec.name} takes {list(shape)}")
    return d

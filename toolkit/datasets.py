"""Real data that ships inside installed packages (no download at run time)."""

from __future__ import annotations

import numpy as np


def load_digits(val_fraction: float = 0.2, seed: int = 0, dtype: str = "float32"):
    """scikit-learn's bundled handwritten digits: 1,797 8x8 images, 10 classes.

    Pixels are scaled to [0, 1]; the split is stratified-free but seeded, the same everywhere.

    Returns:
        ``(x_train, y_train), (x_val, y_val)`` with ``x`` of shape ``(n, 64)`` and integer
        labels ``y``.
    """
    from sklearn.datasets import load_digits as _load  # lazy: importing toolkit stays light

    data = _load()
    x = (data.data / 16.0).astype(dtype)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_val = int(round(len(x) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    return (x[train], y[train]), (x[val], y[val])

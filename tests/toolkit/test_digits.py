"""load_digits reads scikit-learn's bundled digits without importing scikit-learn (about 2 s
of SciPy per process, paid by every rank of every launch) and returns exactly its data."""

import subprocess
import sys

import numpy as np


def test_same_data_as_scikit_learn_without_importing_it():
    code = ("import sys; from toolkit.datasets import load_digits; load_digits(); "
            "print(sorted(m for m in ('sklearn', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out

    from sklearn.datasets import load_digits as sklearn_digits

    from toolkit.datasets import load_digits

    (x, y), (xv, yv) = load_digits(val_fraction=0.2, seed=3, dtype="float64")
    want = sklearn_digits()
    order = np.random.default_rng(3).permutation(len(want.data))
    n_val = int(round(len(want.data) * 0.2))
    np.testing.assert_array_equal(xv, want.data[order[:n_val]] / 16.0)
    np.testing.assert_array_equal(x, want.data[order[n_val:]] / 16.0)
    np.testing.assert_array_equal(yv, want.target[order[:n_val]])
    np.testing.assert_array_equal(y, want.target[order[n_val:]])
    assert x.dtype == np.float64 and y.dtype == np.int64

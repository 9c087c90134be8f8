"""Real data that ships inside installed packages (no download at run time), and the staging of
a data set to node-local storage (:func:`stage`, from ``toolkit/data/staging.py``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from toolkit.data.staging import stage
from toolkit.errors import ToolkitError
from toolkit.launch.env import LaunchEnv
from toolkit.launch.rank0 import atomic_open


def load_digits(val_fraction: float = 0.2, seed: int = 0, dtype: str = "float32"):
    """scikit-learn's bundled handwritten digits: 1,797 8x8 images, 10 classes.

    Pixels are scaled to [0, 1]; the split is stratified-free but seeded, the same everywhere.

    Returns:
        ``(x_train, y_train), (x_val, y_val)`` with ``x`` of shape ``(n, 64)`` and integer
        labels ``y``.
    """
    data = _digits_table()
    x = (data[:, :-1] / 16.0).astype(dtype)
    y = data[:, -1].astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_val = int(round(len(x) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    return (x[train], y[train]), (x[val], y[val])


def _digits_table() -> np.ndarray:
    """The rows of scikit-learn's ``datasets/data/digits.csv.gz`` (64 pixels, then the label),
    read as ``sklearn.datasets.load_digits`` reads them but without importing scikit-learn,
    which costs about 2 s per process (SciPy): every rank of every launch pays it."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ToolkitError("scikit-learn is not installed: its bundled digits are the data",
                           "pip install scikit-learn (make install does)")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets/data/digits.csv.gz"
    with gzip.open(path, "rt") as f:
        return np.loadtxt(f, delimiter=",")


@dataclasses.dataclass(frozen=True, eq=False)  # no == on memmaps
class TextCorpus:
    """A byte-level text corpus, memory-mapped from its cache file (what :func:`load_text`
    returns).

    Attributes:
        train: the first ``1 - val_fraction`` of the bytes, a read-only ``uint8`` memmap.
        val: the remaining bytes, likewise.
        sha256: hex SHA-256 of all the corpus bytes (``train`` then ``val``); the same on every
            machine with the same Python build.
        files: how many source files were concatenated.
        path: the cache file (``.npy``) the arrays map.
        vocab: 256, the byte values.
    """

    train: np.ndarray
    val: np.ndarray
    sha256: str
    files: int
    path: Path
    vocab: int = 256

    @property
    def num_bytes(self) -> int:
        return len(self.train) + len(self.val)

    def unigram_entropy(self, tokens: np.ndarray) -> float:
        """The entropy in nats of the byte frequencies of ``tokens``: the loss of the best model
        that ignores context, fitted to these very bytes (``log(256) = 5.545`` is a uniform
        guess). A language model that learns anything beats it.

        Example:
            >>> text = load_text()                                 # doctest: +SKIP
            >>> text.unigram_entropy(text.val)                     # doctest: +SKIP
            3.25...
        """
        counts = np.zeros(self.vocab, np.int64)
        for start in range(0, len(tokens), 1 << 24):  # bincount copies its input to intp
            counts += np.bincount(np.asarray(tokens[start:start + (1 << 24)]).reshape(-1),
                                  minlength=self.vocab)[:self.vocab]
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


def text_cache_dir() -> Path:
    """Where :func:`load_text` keeps its corpus: ``$TOOLKIT_CACHE/text`` (the variable
    ``tools/install.sh`` caches the Horovod wheel under), else
    ``${XDG_CACHE_HOME:-~/.cache}/hpc-toolkit/text``."""
    root = os.environ.get("TOOLKIT_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpc-toolkit"
    return Path(root) / "text"


def stdlib_sources() -> tuple[Path, list[Path]]:
    """The running interpreter's standard-library directory and its ``.py`` files in the
    corpus order (sorted by path; ``site-packages``/``dist-packages`` left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
    return root, sorted(files, key=lambda p: p.relative_to(root).parts)


def load_text(cache_dir: str | os.PathLike | None = None, *,
              val_fraction: float = 0.05) -> TextCorpus:
    """Real text every machine has: the Python standard library's own ``.py`` sources, as bytes.

    The running interpreter's standard-library files (:func:`stdlib_sources`) are concatenated
    once into a ``uint8`` cache file, then memory-mapped, so every later call (and every rank)
    maps the same file instead of reading 30 MB of sources. The cache is written atomically
    (temporary file, then rename), so ranks that start at once can all build it safely. Its
    name holds the Python version and the library's path; delete it to rebuild.

    Args:
        cache_dir: the folder for the cache file; default :func:`text_cache_dir`
            (``$TOOLKIT_CACHE/text`` or ``~/.cache/hpc-toolkit/text``).
        val_fraction: the last fraction of the bytes held out for validation (a fixed split:
            no shuffling, so validation text never overlaps training text).

    Returns:
        A :class:`TextCorpus`: ``train`` and ``val`` byte arrays (memmaps), ``sha256``,
        ``files``, ``unigram_entropy(tokens)``.

    Example:
        >>> text = load_text()                                             # doctest: +SKIP
        >>> train = toolkit.TokenWindows(text.train, context=64)          # doctest: +SKIP
    """
    if not 0 <= val_fraction < 1:
        raise ToolkitError(f"val_fraction={val_fraction!r} must lie in [0, 1)",
                           "e.g. 0.05 holds out the last 5% of the bytes")
    root = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(f"{sys.version}|{root}".encode()).hexdigest()[:12]
    name = f"stdlib-py{'.'.join(map(str, sys.version_info[:3]))}-{key}"
    folder = Path(cache_dir) if cache_dir is not None else text_cache_dir()
    npy, meta_file = folder / f"{name}.npy", folder / f"{name}.json"
    meta, tokens = _read_cache(npy, meta_file)
    if tokens is None:
        root, files = stdlib_sources()
        data = b"".join(p.read_bytes() for p in files)
        if not data:
            raise ToolkitError(f"no .py files under the standard library {root}",
                               "run with a Python installation that ships its sources")
        meta = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "files": len(files), "python": sys.version, "stdlib": str(root)}
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with atomic_open(meta_file, "w") as f:  # first: a cache file always has its meta
                json.dump(meta, f, indent=1)
            with atomic_open(npy, "wb") as f:
                np.save(f, np.frombuffer(data, np.uint8), allow_pickle=False)
            for path in (meta_file, npy):  # readable by every user of a shared cache
                path.chmod(0o644)
        except OSError as err:
            raise ToolkitError(f"cannot write the text cache {npy}: {err.strerror or err}",
                               "pass load_text(cache_dir=...) or set TOOLKIT_CACHE to a "
                               "writable folder") from err
        meta, tokens = _read_cache(npy, meta_file)
        assert tokens is not None
    n_val = int(round(len(tokens) * val_fraction))
    cut = len(tokens) - n_val
    return TextCorpus(train=tokens[:cut], val=tokens[cut:], sha256=meta["sha256"],
                      files=int(meta["files"]), path=npy)


def stage_text(corpus: TextCorpus, local_dir: str | os.PathLike | None = None, *,
               env: LaunchEnv | None = None) -> TextCorpus:
    """The same corpus, memory-mapped from a node-local copy of its cache file.

    Every rank calls it; local rank 0 of each node copies the cache file once (:func:`stage`)
    and every rank maps the copy. The split, hash and fingerprints stay those of ``corpus``, so
    a checkpoint resumes across staged and unstaged runs.

    Args:
        corpus: what :func:`load_text` returned (its cache file on shared storage).
        local_dir: the node-local directory; default ``$SLURM_TMPDIR``, else ``$TMPDIR``.
        env: the launch environment; the detected one when omitted.

    Example:
        >>> text = stage_text(load_text())         # doctest: +SKIP
    """
    local = stage(corpus.path, local_dir, env=env)
    tokens = np.load(local, mmap_mode="r", allow_pickle=False)
    if tokens.shape != (corpus.num_bytes,) or tokens.dtype != np.uint8:
        raise ToolkitError(f"the staged {local} holds {tokens.dtype}{list(tokens.shape)}, not "
                           f"the corpus's {corpus.num_bytes} bytes",
                           f"its cache file {corpus.path} was rebuilt meanwhile: load the "
                           "corpus again, then stage it")
    cut = len(corpus.train)
    return dataclasses.replace(corpus, train=tokens[:cut], val=tokens[cut:], path=local)


def _read_cache(npy: Path, meta_file: Path) -> tuple[dict, np.ndarray | None]:
    """The cached corpus and its metadata, or ``({}, None)`` when absent or inconsistent."""
    try:
        meta = json.loads(meta_file.read_text())
        tokens = np.load(npy, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return {}, None
    if tokens.dtype != np.uint8 or tokens.ndim != 1 or len(tokens) != meta.get("bytes"):
        return {}, None
    return meta, tokens

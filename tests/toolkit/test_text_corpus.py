"""load_text: the standard library's sources as one cached, memory-mapped byte corpus."""

import hashlib
import math

import numpy as np
import pytest

from toolkit import ToolkitError
from toolkit.datasets import load_text, stdlib_sources, text_cache_dir


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("text-cache")


@pytest.fixture(scope="module")
def text(cache):
    return load_text(cache)


def test_built_once_then_reused(text, cache):
    files = sorted(cache.iterdir())
    assert [f.suffix for f in files] == [".json", ".npy"]
    mtimes = [f.stat().st_mtime_ns for f in files]
    again = load_text(cache)
    assert [f.stat().st_mtime_ns for f in files] == mtimes  # read, not rewritten
    assert again.sha256 == text.sha256 and again.files == text.files
    assert isinstance(again.train, np.memmap) and isinstance(again.val, np.memmap)
    assert again.train.dtype == np.uint8 and str(again.path) == str(text.path)


def test_the_bytes_are_the_sorted_sources_concatenated(text):
    root, files = stdlib_sources()
    assert len(files) == text.files > 100
    assert all("site-packages" not in p.parts and "dist-packages" not in p.parts for p in files)
    relative = [p.relative_to(root).parts for p in files]
    assert relative == sorted(relative)
    head = b"".join(p.read_bytes() for p in files[:3])
    assert bytes(text.train[:len(head)]) == head
    assert text.num_bytes == sum(p.stat().st_size for p in files)
    tail = files[-1].read_bytes()
    assert bytes(text.val[len(text.val) - len(tail):]) == tail


def test_hash_and_split(text, cache):
    digest = hashlib.sha256()
    digest.update(text.train)
    digest.update(text.val)
    assert digest.hexdigest() == text.sha256
    assert len(text.val) == round(0.05 * text.num_bytes)
    other = load_text(cache, val_fraction=0.2)
    assert other.sha256 == text.sha256 and len(other.val) == round(0.2 * text.num_bytes)
    assert len(load_text(cache, val_fraction=0).val) == 0
    with pytest.raises(ToolkitError, match=r"val_fraction=1.5 must lie in \[0, 1\)"):
        load_text(cache, val_fraction=1.5)


def test_same_corpus_as_the_equivalence_check(text):
    from toolkit.equivalence import stdlib_bytes

    np.testing.assert_array_equal(stdlib_bytes(70_000), text.train[:70_000])


def test_unigram_entropy(text):
    value = text.unigram_entropy(text.val)
    assert 0 < value < math.log(256)
    counts = np.bincount(np.asarray(text.val[:5000]), minlength=256)
    p = counts[counts > 0] / 5000
    assert text.unigram_entropy(text.val[:5000]) == pytest.approx(-(p * np.log(p)).sum())
    assert text.unigram_entropy(np.full(10, 7, np.uint8)) == 0.0


def test_a_damaged_cache_is_rebuilt(text, tmp_path):
    first = load_text(tmp_path)
    first.path.write_bytes(b"not an npy file")
    rebuilt = load_text(tmp_path)
    assert rebuilt.sha256 == text.sha256 and rebuilt.num_bytes == text.num_bytes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "shared"))
    assert text_cache_dir() == tmp_path / "shared" / "text"
    monkeypatch.delenv("TOOLKIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert text_cache_dir() == tmp_path / "xdg" / "hpc-toolkit" / "text"

"""Data by sample index: the Dataset contract and in-memory datasets (``dataset.py``), the
shared sampler that partitions each global batch as sequential training would see it
(``sampler.py``), the background loading of the next batch (``prefetch.py``), and the copy of
a data set to each node's local storage (``staging.py``)."""

"""Parallel layouts as plain data (``layouts.py``), the flat-shard arithmetic of ZeRO / FSDP
(``shards.py``) and the pipeline's numpy-free parts (``pipeline/``)."""

"""Checkpoints: the framework-neutral store (``store.py``), the settings a checkpoint records
and a resume compares (``settings.py``), and resuming a Trainer from one (``resume.py``)."""

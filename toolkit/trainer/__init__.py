"""The training loop: the Trainer (``trainer.py``), its checkpoints and stop signals
(``checkpoints.py``, ``preemption.py``), the evaluation split over ranks, the History a run
returns and rank 0's start-up summary."""

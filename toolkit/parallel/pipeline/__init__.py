"""Pipeline stages without a framework: the model's cut and the rank grid (``partition.py``),
schedules as data (``schedules.py``), their validator, lockstep rounds and simulator
(``simulation.py``), and measured timelines (``timeline.py``)."""

"""The launch: who a process is among how many (``env.py``, for python, horovodrun, mpirun and
srun), which device it computes on (``devices.py``), rank-0 printing and saving
(``rank0.py``), the Trainer's command-line options (``options.py``) and the wrapper that
turns errors into one clear line (``cli.py``)."""

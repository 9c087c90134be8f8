"""Framework-neutral model, optimizer and schedule specs (``specs.py``, the GPT in ``gpt.py``),
their numpy reference arithmetic (``reference.py``) and GPT-2's files (``gpt2_files.py``)."""

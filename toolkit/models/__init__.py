"""Framework-neutral model, optimizer and schedule specs (``specs.py``, the GPT in ``gpt.py``,
the values of their options in ``choices.py``), their numpy reference arithmetic
(``reference.py``) and GPT-2's files (``gpt2_files.py``)."""

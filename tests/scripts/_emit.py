"""How the multi-rank test workers report to their test: ``emit(result)``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import toolkit


def emit(result: dict) -> None:
    """Appends ``result`` as one JSON line to ``$TOOLKIT_TEST_RESULTS/rank<R>.jsonl``; the
    ``launch`` fixture (tests/conftest.py) sets the folder and reads it back as
    ``job.results``. Not stdout: mpirun forwards each rank's output in chunks and can put
    another rank's chunk in the middle of a line. Printed when run by hand."""
    line = json.dumps(result)
    folder = os.environ.get("TOOLKIT_TEST_RESULTS")
    if not folder:
        print("RESULT " + line, flush=True)
        return
    with open(Path(folder) / f"rank{toolkit.current_env().rank}.jsonl", "a") as f:
        f.write(line + "\n")

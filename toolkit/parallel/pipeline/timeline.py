"""Measured pipeline timelines: one JSON line per executed action.

A record: ``{"stage": 1, "replica": 0, "step": 3, "action": "F2.c1", "micro_batch": 2,
"chunk": 1, "start": 12.004, "end": 12.031}`` (seconds; ``step`` is optional, 0 when absent).
Each rank writes its own file with a ``StageRecorder``; ``read_timeline`` merges any number of
them, and ``python -m toolkit.pipeline_timeline`` draws them. Times from different processes
are comparable when they share a clock: ``time.time()`` on one node; across nodes subtract each
rank's time of a common barrier (``StageRecorder(origin=...)``).

An action may have more than one record: horovod-tf adds a backward's parameter gradients to
the step's sums later, while the stage waits for a message, and records that as a second part
of the backward (``action_seconds`` and ``stage_times`` add the parts up).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from toolkit.errors import ToolkitError
from toolkit.parallel.pipeline.schedules import Action

FIELDS = ("stage", "replica", "action", "micro_batch", "chunk", "start", "end")


def record(stage: int, replica: int, action: Action | str, start: float, end: float,
           step: int = 0) -> dict:
    """One timeline record (a plain dict, one JSON line)."""
    a = action if isinstance(action, Action) else Action.parse(action)
    return {"stage": int(stage), "replica": int(replica), "step": int(step), "action": str(a),
            "micro_batch": a.micro_batch, "chunk": a.chunk, "start": float(start),
            "end": float(end)}


class StageRecorder:
    """Collects when each of one stage's actions starts and ends; writes them as JSON lines.

    Args:
        stage: this rank's pipeline stage.
        replica: this rank's data-parallel replica.
        origin: subtracted from every time (e.g. the time of a barrier all ranks passed).
        clock: seconds as a float; ``time.time`` (shared by the processes of one node).

    Example:
        >>> rec = StageRecorder(stage=0, replica=0)
        >>> with rec.action("F0", step=1):
        ...     pass
        >>> rec.records[0]["action"], rec.records[0]["step"]
        ('F0', 1)
    """

    def __init__(self, stage: int, replica: int = 0, origin: float = 0.0,
                 clock: Callable[[], float] = time.time):
        self.stage, self.replica, self.origin, self.clock = stage, replica, origin, clock
        self.records: list[dict] = []

    def add(self, action: Action | str, start: float, end: float, step: int = 0) -> None:
        """Records ``action`` as having run from ``start`` to ``end`` (clock seconds)."""
        self.records.append(record(self.stage, self.replica, action, start - self.origin,
                                   end - self.origin, step))

    @contextlib.contextmanager
    def action(self, action: Action | str, step: int = 0) -> Iterator[None]:
        """Times the ``with`` body as ``action`` (only when it finishes without an error).

        The body must wait for its work to finish (``torch.cuda.synchronize``, JAX's
        ``block_until_ready``): an asynchronous framework returns when the work is queued.
        """
        start = self.clock()
        yield
        self.add(action, start, self.clock(), step)

    def save(self, path: str | os.PathLike) -> None:
        """Writes every record so far to ``path`` (one JSON object a line), atomically."""
        write_timeline(self.records, path)


# Set to a folder, it makes the backends' pipeline executors append every step's records there.
TIMELINE_ENV = "TOOLKIT_PIPELINE_TIMELINE"


def append_timeline(records: Iterable[dict], folder: str | os.PathLike, stage: int,
                    replica: int) -> None:
    """Appends one stage's ``records`` to ``folder/stage<S>-replica<D>.jsonl`` (the files
    ``python -m toolkit.pipeline_timeline FOLDER`` reads)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"stage{stage}-replica{replica}.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def write_timeline(records: Iterable[dict], path: str | os.PathLike) -> None:
    """Writes ``records`` to ``path`` as JSON lines, atomically (a reader never sees half)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)


def _files(paths: Iterable[str | os.PathLike]) -> list[str]:
    out = []
    for p in map(str, paths):
        if os.path.isdir(p):
            out += sorted(os.path.join(p, n) for n in os.listdir(p) if n.endswith(".jsonl"))
        elif os.path.exists(p):
            out.append(p)
        else:
            raise ToolkitError(f"timeline file {p!r} does not exist",
                               "pass the .jsonl files (or their folder) the stages wrote")
    return out


def read_timeline(paths: Iterable[str | os.PathLike]) -> list[dict]:
    """Every record of the JSON-lines files (or folders of ``*.jsonl``) ``paths``."""
    records = []
    for path in _files(paths):
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    missing = [k for k in FIELDS if k not in r]
                except json.JSONDecodeError:
                    missing = ["valid JSON"]
                if missing:
                    raise ToolkitError(f"{path}:{n} is not a timeline record (lacks "
                                       f"{', '.join(missing)})",
                                       f"each line needs {', '.join(FIELDS)}")
                r.setdefault("step", 0)
                records.append(r)
    if not records:
        raise ToolkitError(f"no timeline records in {list(map(str, paths))}",
                           "run the pipeline with its timeline recording switched on")
    return records


def select(records: list[dict], step: int | None = None, replica: int = 0) -> list[dict]:
    """One step (default: the last) of one replica's records."""
    mine = [r for r in records if r["replica"] == replica]
    if not mine:
        raise ToolkitError(f"no records of replica {replica}",
                           f"replicas present: {sorted({r['replica'] for r in records})}")
    step = max(r["step"] for r in mine) if step is None else step
    chosen = [r for r in mine if r["step"] == step]
    if not chosen:
        raise ToolkitError(f"no records of step {step}",
                           f"steps present: {sorted({r['step'] for r in mine})}")
    return chosen


def _compute(r: dict) -> bool:
    return r["action"][0] in "FB" and not r["action"].startswith(("SEND", "RECV"))


def idle_fraction(records: list[dict]) -> float:
    """Measured bubble of one step of one replica: 1 - time in forwards and backwards over
    ``stages x`` (last end - first start). Sends, receives and waiting count as idle."""
    stages = len({r["stage"] for r in records})
    span = max(r["end"] for r in records) - min(r["start"] for r in records)
    busy = sum(r["end"] - r["start"] for r in records if _compute(r))
    return 1.0 - busy / (stages * span) if span > 0 else 0.0


def peak_in_flight(records: list[dict]) -> dict[int, int]:
    """Per stage, the most forwards whose backward had not started, by the recorded order (an
    action recorded in parts counts at its first)."""
    peaks = {}
    for stage in sorted({r["stage"] for r in records}):
        live = peak = 0
        seen = set()
        for r in sorted((r for r in records if r["stage"] == stage and _compute(r)),
                        key=lambda r: r["start"]):
            if r["action"] in seen:
                continue
            seen.add(r["action"])
            live += 1 if r["action"][0] == "F" else -1
            peak = max(peak, live)
        peaks[stage] = peak
    return peaks


def action_seconds(records: list[dict]) -> dict[tuple[int, str], float]:
    """Each (stage, action)'s time, its parts added up (one step of one replica)."""
    total: dict[tuple[int, str], float] = {}
    for r in records:
        key = (r["stage"], r["action"])
        total[key] = total.get(key, 0.0) + r["end"] - r["start"]
    return total


def stage_times(records: list[dict], stages: int,
                chunks: int = 1) -> tuple[list[float], list[float]]:
    """Per stage, the mean forward and mean backward time of one micro-batch through all its
    ``chunks`` (one step of one replica; an action recorded in parts counts as their sum)."""
    seconds = action_seconds(records)
    out = []
    for kind in ("F", "B"):
        per = []
        for s in range(stages):
            d = [t for (stage, a), t in seconds.items()
                 if stage == s and Action.parse(a).kind == kind]
            per.append(chunks * sum(d) / len(d) if d else 0.0)
        out.append(per)
    return out[0], out[1]

"""The stall watch's verdict: from what each rank last said (its phase and step, when it was
heard, whether its connection closed), which ranks did not arrive and what the others wait in.
Rank 0's side of ``toolkit.launch.stall`` calls :func:`diagnose` about once a second."""

from __future__ import annotations

import time

# What a rank is doing, as the message says it; the order is the order within one step.
PHASES = {
    "start": "start-up (building the model, restoring a checkpoint)",
    "input": "loading its batch",
    "step": "the step's collectives",
    "checkpoint": "writing a checkpoint",
    "evaluation": "evaluation",
    "idle": "outside training",
}
_ORDER = {name: i for i, name in enumerate(PHASES)}


class Rank:
    """What rank 0 knows of one rank."""

    def __init__(self, rank: int, host: str = "?"):
        self.rank, self.host = rank, host
        self.phase, self.step, self.seconds_in_phase = "start", 0, 0.0
        self.heard = time.monotonic()  # the last message (rank 0's own clock)
        self.closed: float | None = None  # when its connection closed while it trained
        self.done = False  # it said goodbye

    def where(self) -> str:
        return f"step {self.step} ({PHASES[self.phase]})" if self.phase not in (
            "start", "idle") else PHASES[self.phase]


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``."""
    parts, start, ranks = [], None, sorted(ranks)
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _hosts(ranks: list[Rank]) -> str:
    return ", ".join(dict.fromkeys(r.host for r in ranks))


def diagnose(ranks: dict[int, Rank], timeout: float, now: float, interval: float = 1.0,
             grace: float = 5.0) -> str | None:
    """The verdict on the ranks' states, or None while nothing is stalled.

    The job ends when a rank has sent nothing for ``timeout`` seconds (stopped, hung with its
    interpreter, its node or link lost), when a rank's connection closed while it trained (its
    process died) ``grace`` seconds ago, or when a rank has been in one phase for
    ``timeout`` seconds. Every rank whose connection has closed by then is named as ended
    (a node's ranks die together, but their connections close a moment apart). The verdict
    names first the ranks silent for three heartbeats (``interval`` apart) or gone, else the
    ranks furthest behind (a collective they never enter), then what the others wait in."""
    live = [r for r in ranks.values() if not r.done]
    gone = [r for r in live if r.closed is not None]
    if not any(now - r.closed > grace for r in gone) and not any(
            r.closed is None and (now - r.heard > timeout or r.phase != "idle" and (
                r.seconds_in_phase + now - r.heard > timeout)) for r in live):
        return None
    silent = [r for r in live if r.closed is None and now - r.heard > 3 * interval]
    lines = []
    for late, how in ((gone, "ended (connection closed) in {where}"),
                      (silent, "sent nothing for {t:.0f} s, last in {where}")):
        for where in dict.fromkeys(r.where() for r in late):
            group = sorted((r for r in late if r.where() == where), key=lambda r: r.rank)
            lines.append(f"{_ranges([r.rank for r in group])} on {_hosts(group)} "
                         + how.format(where=where, t=min(now - r.heard for r in group)))
    others = [r for r in live if r not in silent and r not in gone]
    if not lines:  # all alive, some stuck: the ones furthest behind did not arrive
        behind = min((r.step, _ORDER[r.phase]) for r in others)
        late = [r for r in others if (r.step, _ORDER[r.phase]) == behind]
        if len(late) < len(others):
            lines.append(f"{_ranges([r.rank for r in late])} on {_hosts(late)} "
                         f"did not arrive: still in {late[0].where()}")
            others = [r for r in others if r not in late]
    for where in dict.fromkeys(r.where() for r in others):
        group = sorted((r for r in others if r.where() == where), key=lambda r: r.rank)
        waited = max(r.seconds_in_phase + now - r.heard for r in group)
        lines.append(f"{_ranges([r.rank for r in group])} on {_hosts(group)} "
                     f"{'wait' if len(group) > 1 else 'waits'} in {where}, for {waited:.0f} s")
    return "\n  ".join(lines)

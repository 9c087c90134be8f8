"""The study's table and picture."""

from __future__ import annotations

import numpy as np

from toolkit.scaling.study import Point, boundaries


def table(points: list[Point]) -> str:
    """The study's table, one row per world size.

    Example:
        >>> head, row = table([Point(1, 1, throughput=10.0, speedup=1.0, efficiency=1.0,
        ...                          step_s=0.1, input_wait_s=0.001, compute_s=0.099,
        ...                          comm_s=0.0)]).splitlines()
        >>> head.split()[5:]
        ['step', 'ms', 'compute', 'ms', 'comm+sync', 'ms', 'input', 'ms', 'status']
        >>> row.split()[5:]
        ['100.0', '99.0', '0.0', '1.00', 'ok']
    """
    unit = next((p.unit for p in points if p.throughput), "samples/s")
    cross = set(boundaries(points))
    rows = [("N", "nodes", unit, "speed-up", "efficiency", "step ms", "compute ms",
             "comm+sync ms", "input ms", "status")]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    for p in points:
        rows.append((str(p.world_size), str(p.nodes) + (" *" if p.world_size in cross else ""),
                     f(p.throughput, ".1f"), f(p.speedup, ".2f"), f(p.efficiency, ".2f"),
                     f(ms(p.step_s), ".1f"), f(ms(p.compute_s), ".1f"), f(ms(p.comm_s), ".1f"),
                     f(ms(p.input_wait_s), ".2f"), p.status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)
    if cross:
        text += "\n* the job spans another node from this size on"
    return text


def draw(studies: dict[str, list[Point]], png: str, mode: str, title: str):
    """Speed-up against the ideal line, efficiency, and where a step's time goes (compute,
    comm+sync, input wait, as the table splits it), of each study (its backend and layout:
    a label's points) into ``png``; returns the Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, split) = plt.subplots(1, 3, figsize=(16, 4.5))
    sizes = sorted({p.world_size for points in studies.values() for p in points})
    left.plot(sizes, sizes, "k--", lw=1, alpha=0.5, label="ideal")
    right.axhline(1.0, color="k", ls="--", lw=1, alpha=0.5, label="ideal")
    top = 1.1
    for i, (label, points) in enumerate(studies.items()):
        ok = [p for p in points if p.speedup is not None]
        n = np.asarray([p.world_size for p in ok])
        left.plot(n, [p.speedup for p in ok], "o-", color=f"C{i}", label=label)
        right.plot(n, [p.efficiency for p in ok], "o-", color=f"C{i}", label=label)
        top = max([top, *[p.efficiency * 1.1 for p in ok]])
    right.set_ylim(0, top)
    first = next(iter(studies.values()), [])
    # a boundary's line halfway between the last size within the nodes before and the first
    # beyond them
    lines = [(max([s for s in sizes if s < b], default=b - 1) + b) / 2 for b in boundaries(first)]
    for ax in (left, right):
        for at in lines:
            ax.axvline(at, color="C3", ls=":", lw=1.5)
            ax.text(at, ax.get_ylim()[1], " next node", color="C3", va="top", fontsize=8)
        for p in first:
            if all(q.status != "ok" for points in studies.values() for q in points
                   if q.world_size == p.world_size):
                ax.axvline(p.world_size, color="0.6", lw=0.8)
                ax.text(p.world_size, ax.get_ylim()[0], "failed ", rotation=90, fontsize=8,
                        ha="right", color="0.4", va="bottom")
        ax.set_xticks(sizes)
        ax.set_xlabel("ranks (N)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set(ylabel="speed-up", title=f"{mode} scaling: speed-up")
    right.set(ylabel="efficiency (speed-up / N)" if mode == "strong" else
              "efficiency (throughput per rank / N=1's)", title="efficiency")
    step_split(split, studies, sizes)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return fig


PARTS = (("compute_s", "compute", "/"), ("comm_s", "comm+sync", "\\\\"),
         ("input_wait_s", "input wait", "."))


def step_split(ax, studies: dict[str, list[Point]], sizes: list[int]) -> None:
    """Stacked bars of each world size's step time (ms) per study, side by side: compute (the
    one-rank reference's step at the same batch per rank), comm+sync (the rest) and input
    wait; a study without the split (``--no-breakdown``) shows its whole step. The colours
    are the studies' (as in the other panels), the hatches the parts (this legend's)."""
    from matplotlib.patches import Patch

    width, shown = 0.8 / max(1, len(studies)), {}
    for i, points in enumerate(studies.values()):
        ok = [p for p in points if p.step_s is not None]
        offset = (i - (len(studies) - 1) / 2) * width
        x = np.asarray([sizes.index(p.world_size) for p in ok]) + offset
        bottom = np.zeros(len(ok))
        for field, part, hatch in PARTS:
            values = np.asarray([(getattr(p, field) or 0.0) * 1e3 for p in ok])
            if field == "compute_s" and all(p.compute_s is None for p in ok):
                values, part = np.asarray([p.step_s * 1e3 for p in ok]), "step"
            ax.bar(x, values, width, bottom=bottom, color=f"C{i}", hatch=hatch,
                   edgecolor="white")
            shown[part] = hatch
            bottom += values
    ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
    ax.set(xlabel="ranks (N)", ylabel="ms per step", title="where a step's time goes")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(handles=[Patch(facecolor="0.55", edgecolor="white", hatch=h, label=part)
                       for part, h in shown.items()], fontsize=8)

"""Where the ranks sit: each node's ranks and what each holds (a replica, a shard, a stage), for
the start-up block's placement table.

Only rank 0 prints, but it knows only its own host name, and launchers say different things
about nodes (Open MPI's ``mpirun`` not even how many there are). So every rank says its host
through the adapter's own ``allreduce`` (the contract's; framework-free here), in two sums of
small float64 arrays that are exact: a 52-bit key of each rank's host name (ranks with the same
key share a node), then the names of the nodes the table shows only (at most ``MAX_NODES``),
as bytes. Nodes are numbered in the order of their first rank.

Large worlds are abbreviated: more than ``MAX_NODES`` nodes show the first ``HEAD_NODES``, a
count and the last; a node of more than ``MAX_RANKS`` ranks shows its first ``HEAD_RANKS``, a
count and its last ``TAIL_RANKS``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

MAX_NODES, HEAD_NODES, TAIL_NODES = 8, 3, 1
MAX_RANKS, HEAD_RANKS, TAIL_RANKS = 8, 4, 3
NAME_BYTES = 64  # a host name's length limit on Linux (HOST_NAME_MAX)
WIDTH = 100  # a table line's length the entries are wrapped to


def host_key(hostname: str) -> float:
    """A 52-bit key of ``hostname``, exact as a float64 (so a sum carries it unchanged)."""
    digest = hashlib.blake2b(hostname.encode(), digest_size=8).digest()
    return float(int.from_bytes(digest, "big") >> 12)


def shown(count: int, limit: int, head: int, tail: int) -> list[int]:
    """The indices of ``count`` items a table shows: all up to ``limit``, else the first
    ``head`` and the last ``tail``."""
    if count <= limit:
        return list(range(count))
    return list(range(head)) + list(range(count - tail, count))


def gather_nodes(allreduce: Callable[[np.ndarray, str], np.ndarray] | None, world_size: int,
                 rank: int, hostname: str) -> list[tuple[str | None, list[int]]]:
    """Every node's ``(host name, ranks)``, in the order of the nodes' first ranks; the name is
    None for a node the table leaves out. A collective: every rank calls it (``allreduce``:
    the adapter's, None for a world of one).

    Example:
        >>> gather_nodes(None, 1, 0, "node1")
        [('node1', [0])]
    """
    if world_size == 1 or allreduce is None:
        return [(hostname, [0])]
    keys = np.zeros(world_size)
    keys[rank] = host_key(hostname)
    keys = np.asarray(allreduce(keys, "sum"))
    first: dict[float, list[int]] = {}
    for r, key in enumerate(keys.tolist()):
        first.setdefault(key, []).append(r)
    groups = list(first.values())
    named = shown(len(groups), MAX_NODES, HEAD_NODES, TAIL_NODES)
    names = np.zeros((len(named), NAME_BYTES))
    mine = hostname.encode()[:NAME_BYTES]
    for row, node in enumerate(named):
        if groups[node][0] == rank:  # a node's first rank says its name
            names[row, :len(mine)] = np.frombuffer(mine, np.uint8)
    names = np.asarray(allreduce(names, "sum"))
    found = {node: bytes(names[row].astype(np.uint8)).rstrip(b"\0").decode(errors="replace")
             for row, node in enumerate(named)}
    return [(found.get(i), ranks) for i, ranks in enumerate(groups)]


def placement_facts(nodes: list[tuple[str | None, list[int]]], layout: Any, world_size: int,
                    local_devices: int = 1) -> dict[str, Any]:
    """The placement table as JSON values: the nodes it shows, each with the ranks it shows
    and what each holds (``layout.holds``), and how many it leaves out.

    Example:
        >>> from toolkit.parallel.layouts import Pipeline
        >>> f = placement_facts([("node1", [0, 1]), ("node2", [2, 3])], Pipeline(2, 4), 4)
        >>> f["nodes"][1]["node"], f["nodes"][1]["holds"]
        ('node2', ['replica 1, stage 0', 'replica 1, stage 1'])
    """
    out = []
    for i in shown(len(nodes), MAX_NODES, HEAD_NODES, TAIL_NODES):
        name, ranks = nodes[i]
        kept = [ranks[j] for j in shown(len(ranks), MAX_RANKS, HEAD_RANKS, TAIL_RANKS)]
        out.append({"index": i, "node": name, "ranks": kept,
                    "holds": [layout.holds(world_size, r, local_devices) for r in kept],
                    "ranks_left_out": len(ranks) - len(kept)})
    return {"node_count": len(nodes), "nodes": out}


def format_placement(placement: dict[str, Any], indent: int) -> list[str]:
    """The table's lines (the first without its ``indent``, the others indented by it):
    ``node1: rank 0 (replica 0, stage 0)  rank 1 (replica 0, stage 1)``, entries in columns,
    wrapped to about ``WIDTH`` characters."""
    nodes = placement["nodes"]
    label = max(len(str(n["node"])) for n in nodes) + 2
    rows: list[tuple[str, list[str]]] = []
    previous = -1
    for n in nodes:
        if n["index"] > previous + 1:
            rows.append((f"... {n['index'] - previous - 1} more node(s) ...", []))
        previous = n["index"]
        entries = [f"rank {r} ({held})" for r, held in zip(n["ranks"], n["holds"], strict=True)]
        if n["ranks_left_out"]:
            entries.insert(HEAD_RANKS, f"... {n['ranks_left_out']} more rank(s) ...")
        rows.append((f"{n['node']}:", entries))
    width = max(len(e) for _, entries in rows for e in entries)
    per_line = max(1, (WIDTH - indent - label + 2) // (width + 2))
    lines = []
    for head, entries in rows:
        if not entries:
            lines.append(head)
            continue
        for k in range(0, len(entries), per_line):
            cells = "  ".join(e.ljust(width) for e in entries[k:k + per_line]).rstrip()
            lines.append(f"{head if k == 0 else '':<{label}}{cells}")
    return [lines[0]] + [" " * indent + line for line in lines[1:]]

"""A pipeline schedule as lockstep rounds for the JAX backends.

``RoundPlan`` turns a schedule into lockstep rounds (``toolkit.lockstep_rounds``): per round and
stage, the compute to run (forward or backward of one piece and micro-batch, or nothing), then
*waves* of messages, each wave at most one activation forward and one gradient backward per stage
(two ``ppermute`` shifts over the stage axis). Activations, received activations (kept for the
backward, which recomputes the piece's forward under ``jax.vjp``) and gradients live in a
per-device *box* of slots; the plan assigns slots statically by simulating every stage's order,
so the box holds exactly the schedule's peak of live values (1F1B's is smaller than GPipe's).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from toolkit.parallel.pipeline.schedules import Action, Schedule
from toolkit.parallel.pipeline.simulation import lockstep_rounds


@dataclasses.dataclass
class Wave:
    """One exchange: per stage ``[send_f, send_b, recv_f, recv_f_valid, recv_b,
    recv_b_valid]`` slots, whether any activation / gradient moves, and each stage's
    SEND/RECV actions."""

    ctrl: np.ndarray
    forward: bool
    backward: bool
    actions: list[list[Action]]


@dataclasses.dataclass
class Round:
    """One lockstep round: per stage ``[branch, micro_batch, act_in, grad_in, out]`` (branch
    0: idle, ``1 + 2k``: forward of piece ``k``, ``2 + 2k``: its backward), then its waves."""

    ctrl: np.ndarray
    compute: tuple[Action | None, ...]
    waves: list[Wave]


class RoundPlan:
    """``schedule`` as lockstep rounds with every value's box slot assigned (see the module
    docstring). Attributes: ``rounds``, ``slots`` (box size, at least 1)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        S, v = schedule.stages, schedule.chunks
        K = S * v
        live: list[dict[tuple, int]] = [{} for _ in range(S)]
        free: list[list[int]] = [[] for _ in range(S)]
        used = [0] * S

        def alloc(s: int, key: tuple) -> int:
            if free[s]:
                slot = free[s].pop(0)
            else:
                slot, used[s] = used[s], used[s] + 1
            live[s][key] = slot
            return slot

        def release(s: int, key: tuple) -> int:
            slot = live[s].pop(key)
            free[s].append(slot)
            free[s].sort()
            return slot

        self.rounds: list[Round] = []
        for lr in lockstep_rounds(schedule):
            ctrl = np.zeros((S, 5), np.int32)
            for s, a in enumerate(lr.compute):
                if a is None:
                    continue
                k, m, c = a.chunk * S + s, a.micro_batch, a.chunk
                row = [1 + 2 * k if a.kind == "F" else 2 + 2 * k, m, 0, 0, 0]
                if a.kind == "F":
                    if k > 0:
                        row[2] = live[s][("act", m, c)]
                    if k < K - 1:
                        row[4] = alloc(s, ("out", m, c))
                else:  # inputs are read before the output is written: free them first
                    if k > 0:
                        row[2] = release(s, ("act", m, c))
                    if k < K - 1:
                        row[3] = release(s, ("gin", m, c))
                    if k > 0:
                        row[4] = alloc(s, ("gout", m, c))
                ctrl[s] = row
            self.rounds.append(Round(ctrl, lr.compute, self._waves(lr.messages, alloc,
                                                                   release, S)))
        self.slots = max(1, *used)

    @staticmethod
    def _waves(messages, alloc, release, S) -> list[Wave]:
        waves: list[list[tuple]] = []
        for msg in messages:  # first fit: one activation and one gradient per stage a wave
            sender, receiver, send, _ = msg
            key = (send.kind, sender)
            for wave in waves:
                if key not in {(m[2].kind, m[0]) for m in wave}:
                    wave.append(msg)
                    break
            else:
                waves.append([msg])
        out = []
        for wave in waves:
            ctrl = np.zeros((S, 6), np.int32)
            actions: list[list[Action]] = [[] for _ in range(S)]
            for sender, _, send, _ in wave:  # sends read the box before receives write it
                forward = send.kind == "SEND_F"
                slot = release(sender, ("out" if forward else "gout", send.micro_batch,
                                        send.chunk))
                ctrl[sender, 0 if forward else 1] = slot
                actions[sender].append(send)
            for _, receiver, send, recv in wave:
                forward = send.kind == "SEND_F"
                slot = alloc(receiver, ("act" if forward else "gin", recv.micro_batch,
                                        recv.chunk))
                ctrl[receiver, 2 if forward else 4] = slot
                ctrl[receiver, 3 if forward else 5] = 1
                actions[receiver].append(recv)
            kinds = {send.kind for _, _, send, _ in wave}
            out.append(Wave(ctrl, "SEND_F" in kinds, "SEND_B" in kinds, actions))
        return out

"""What activation checkpointing saves and costs: a GPT's forward pass with and without
``activation_checkpointing`` (each block keeps its input only and recomputes the rest in the
backward pass), horovod-torch's spec model on one process.

    .venv/bin/python benchmarks/activation_checkpointing.py --context 512 --batch 4

Per setting: the bytes autograd keeps for the backward pass (every tensor it saves, counted by
``torch.autograd.graph.saved_tensors_hooks``: exact, whatever else the machine does), the
estimator's figure for the same GPT (``python -m toolkit.memory --activation-checkpointing``),
and the median time of forward + backward over ``--repeats`` runs, alternating settings. The
activations dominate at long context, where the attention's T x T weights grow fastest.
"""

import argparse
import statistics
import time

import torch
from _gpt import gpt_options, gpt_spec

from adapters.horovod_torch.models.spec import build_spec_model, saved_bytes
from toolkit.memory import gpt_activation_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpt_options(p, context=512, batch=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    spec = gpt_spec(args)
    x = torch.randint(0, 256, (args.batch, args.context))
    nets = {r: build_spec_model(torch, spec, r)[0] for r in (False, True)}
    saved = {r: saved_bytes(torch, lambda net=net: net(x).sum()) for r, net in nets.items()}
    times = {False: [], True: []}
    for _ in range(args.repeats):
        for recompute, net in nets.items():
            start = time.perf_counter()
            net(x).sum().backward()
            times[recompute].append(time.perf_counter() - start)
    print(f"GPT {spec.num_params:,} parameters, {args.layers} blocks, width {args.width}, "
          f"{args.heads} heads, micro-batch {args.batch} x {args.context} tokens, float32")
    print(f"{'recompute':10s} {'saved by autograd':>18s} {'estimator':>14s} {'step ms':>9s}")
    for recompute in (False, True):
        est = gpt_activation_bytes(args.layers, args.width, args.context, args.batch,
                                   args.heads, recompute=recompute)
        print(f"{'yes' if recompute else 'no':10s} {saved[recompute]:>18,} {est:>14,} "
              f"{statistics.median(times[recompute]) * 1e3:>9.1f}")
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"recomputing keeps {saved[True] / saved[False]:.1%} of the bytes and takes "
          f"{ratio:.2f}x the time of a forward and backward pass")


if __name__ == "__main__":
    main()

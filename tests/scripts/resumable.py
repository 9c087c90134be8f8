"""Digits (MLP) or text (tiny GPT) training that can kill itself (kill-and-resume tests).

--kill-after N: once the checkpoint of step N is written and every rank has reached it, every
rank SIGKILLs itself, as a node failure would. Rerun with --resume latest to continue.
--nan-at K: one sample of step K's global batch is NaN (or --poison V; the divergence guard
must stop there).
"""

import argparse
import os
import signal

import numpy as np

import adapters
import toolkit
from toolkit.datasets import load_digits
from toolkit.equivalence import load_data, make_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="horovod-torch")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--resume", default=None)
    p.add_argument("--kill-after", type=int, default=None)
    p.add_argument("--async-checkpoint", action="store_true")
    p.add_argument("--save-model", required=True)
    p.add_argument("--metrics-log", required=True)
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--layout", default="data")
    p.add_argument("--batch-size", type=int, default=64, help="global")
    p.add_argument("--mlp", default="64,32,10", help="the digits MLP's widths")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--nan-at", default=None, help="poison a sample of these steps (1,2,...)")
    p.add_argument("--poison", type=float, default=float("nan"), help="the poisoned value")
    p.add_argument("--divergence-factor", type=float, default=None)
    p.add_argument("--clip-grad-norm", type=float, default=None)
    p.add_argument("--divergence-window", type=int, default=20)
    p.add_argument("--on-nonfinite", default="stop")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--max-consecutive-skips", type=int, default=5)
    args = p.parse_args()

    if args.model == "gpt":  # the equivalence preset: 2 blocks, width 32, 16-byte windows
        x, y = load_data("gpt", "float32")
        model = make_model("gpt")
    else:
        (x, y), _ = load_digits()
        model = toolkit.MLP(tuple(int(w) for w in args.mlp.split(",")))
    if args.nan_at is not None:  # the global batches do not depend on the world size
        batches = toolkit.GlobalBatchSampler(len(x), args.batch_size, world_size=1, rank=0,
                                             shuffle=True, seed=0)
        x = np.array(x)
        poisoned = {int(k) for k in args.nan_at.split(",")}
        for k, idx in enumerate(batches, 1):
            if k in poisoned:
                x[idx[0]] = args.poison
    adapter = adapters.get(args.backend)
    trainer = toolkit.Trainer(
        adapter, model, toolkit.Adam(lr=args.lr), global_batch_size=args.batch_size,
        layout=args.layout,
        max_steps=args.steps, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, keep=args.keep, resume=args.resume,
        async_checkpoint=args.async_checkpoint, metrics_log=args.metrics_log, progress=False,
        divergence_factor=args.divergence_factor, divergence_window=args.divergence_window,
        clip_grad_norm=args.clip_grad_norm, on_nonfinite=args.on_nonfinite,
        max_consecutive_skips=args.max_consecutive_skips)
    if args.kill_after is not None:
        real_save = trainer.save_checkpoint

        def save_then_maybe_die():
            path = real_save()
            if trainer.global_step == args.kill_after:
                trainer.store.wait()
                adapter.barrier()  # the checkpoint is complete before anyone dies
                os.kill(os.getpid(), signal.SIGKILL)
            return path

        trainer.save_checkpoint = save_then_maybe_die
    trainer.fit(x, y)
    state = adapter.state_dict()
    toolkit.save0(args.save_model, lambda f: np.savez(f, **state))


if __name__ == "__main__":
    toolkit.run(main)

"""Train a small GPT on the Python standard library's own source code, bytes as tokens.

    python examples/train_gpt.py --steps 200                       # one process
    horovodrun -np 2 python examples/train_gpt.py                  # or: mpirun -np 2 ...
    srun -n 2 --mpi=pmix python examples/train_gpt.py              # inside a Slurm job

Every ``--eval-every`` steps rank 0 prints the training loss, the validation loss in nats and
bits per byte (beside the unigram entropy of the validation bytes: what a model that ignores
context would score) and tokens per second, and writes the validation loss to the metrics
log (``eval`` records); at the end it evaluates the whole validation split, or its first
``--final-eval-windows`` windows, printing its progress every few seconds, and samples a
continuation of a fixed prompt from the trained model. Kill it and rerun with ``--resume
latest`` to continue.
``--stage-data [DIR]`` first copies the corpus to each node's local disk (``DIR``, else
``$SLURM_TMPDIR`` or ``$TMPDIR``), once per node, and trains on that copy.
"""

import math
import time

import numpy as np

import adapters
import toolkit
from toolkit.datasets import load_text, stage_text

PROMPT = "def __init__(self"


def main() -> None:
    p = toolkit.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="horovod-torch",
                   help=f"one of {', '.join(adapters.BACKENDS)}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--context", type=int, default=128)
    # steps, batch, layout, checkpoints, resume, clipping, the divergence guard, the device
    toolkit.add_trainer_options(p, skip=("epochs", "eval_every"), steps=1500, batch_size=32)
    p.add_argument("--lr", type=float, default=3e-3, help="peak (AdamW, warm-up + cosine)")
    p.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help="the parameters' dtype (float64: as --precision 64)")
    p.add_argument("--local-devices", type=int, default=None,
                   help="JAX backends: CPU devices per process")
    p.add_argument("--eval-every", type=int, default=250, help="steps between evaluations")
    p.add_argument("--eval-windows", type=int, default=256,
                   help="validation windows used at each interval")
    p.add_argument("--final-eval-windows", type=int, default=None, metavar="N",
                   help="validation windows of the final evaluation: the first N (0 skips "
                        "it; default: all)")
    p.add_argument("--sample-bytes", type=int, default=200)
    p.add_argument("--stage-data", nargs="?", const="", default=None, metavar="DIR",
                   help="copy the corpus to node-local storage first, once per node: DIR, "
                        "else $SLURM_TMPDIR or $TMPDIR")
    args = p.parse_args()
    if args.eval_every < 1:
        p.error(f"--eval-every {args.eval_every}: the steps between evaluations must be at "
                "least 1 (to evaluate only at the end, give --eval-every the --steps value)")
    if args.final_eval_windows is not None and args.final_eval_windows < 0:
        p.error(f"--final-eval-windows {args.final_eval_windows} must be >= 0 (0 skips the "
                "final evaluation)")

    corpus = load_text()  # its cache file, built once on shared storage
    if args.stage_data is not None:
        corpus = stage_text(corpus, args.stage_data or None)
    train = toolkit.TokenWindows(corpus.train, args.context)
    val = toolkit.TokenWindows(corpus.val, args.context)
    val_head = toolkit.TokenWindows(corpus.val[:args.eval_windows * args.context + 1],
                                    args.context)
    entropy = corpus.unigram_entropy(corpus.val)
    model = toolkit.GPT(vocab=256, context=args.context, width=args.width, layers=args.layers,
                        heads=args.heads)
    schedule = toolkit.WarmupCosine(args.lr, max(1, args.steps // 20), args.steps,
                                    end=args.lr / 10)
    trainer = toolkit.Trainer(
        adapters.get(args.backend, dtype=args.dtype, precision=args.precision,
                     local_devices=args.local_devices),
        model, toolkit.Adam(lr=schedule, b2=0.99, weight_decay=0.1, decoupled=True),
        **{**toolkit.trainer_options(args), "max_steps": 0})
    toolkit.print0(f"GPT {model.num_params:,} parameters; corpus {corpus.files} files, "
                   f"{len(corpus.train):,} training bytes; validation unigram entropy "
                   f"{entropy:.3f} nats/byte")
    trainer.fit(train)  # max_steps=0: sets up (and resumes) without training
    loaded = waited = 0.0  # input loading, and how much of it training waited for
    started = time.perf_counter()
    while trainer.global_step < args.steps:  # train in intervals, evaluating after each
        interval = trainer.global_step // args.eval_every + 1
        trainer.max_steps = min(args.steps, interval * args.eval_every)
        began = time.perf_counter()
        history = trainer.fit(train)
        loaded += trainer.prefetch_stats["load_seconds"]
        waited += trainer.prefetch_stats["wait_seconds"]
        steps = trainer.global_step - history.first_step
        tokens = steps * args.batch_size * args.context / (time.perf_counter() - began)
        v = trainer.evaluate(val_head, log=False)["val_loss"]
        trainer.log_record({"event": "eval", "step": trainer.global_step, "val_loss": v,
                            "val_windows": len(val_head)})
        toolkit.print0(f"step {trainer.global_step:5d}  loss {history.final_loss:.4f}  "
                       f"val {v:.4f} nats/byte ({v / math.log(2):.3f} bits/byte)  "
                       f"{tokens:,.0f} tokens/s")
    windows = len(val) if args.final_eval_windows is None else min(len(val),
                                                                    args.final_eval_windows)
    done = f"done: world_size {trainer.env.world_size}  steps {trainer.global_step}  "
    if windows == 0:
        toolkit.print0(done + "final evaluation skipped (--final-eval-windows 0)")
    else:
        final = final_eval(trainer, corpus.val, args.context, windows)
        trainer.log_record({"event": "eval", "step": trainer.global_step, "val_loss": final,
                            "val_windows": windows, "final": True})
        toolkit.print0(done + f"val_loss {final:.4f} nats/byte = {final / entropy:.2f} x the "
                       f"unigram entropy {entropy:.3f}"
                       + ("" if windows == len(val) else f" ({windows:,} of {len(val):,} "
                                                          "validation windows)"))
    if loaded > 0:  # two clocks: the wait is not a part of the loading (prefetch.stats)
        wall = time.perf_counter() - started
        toolkit.print0(f"input: the prefetch thread spent {loaded:.2f} s loading batches; the "
                       f"training loop waited {waited:.2f} s for them ({waited / wall:.2%} of "
                       f"its {wall:.0f} s; the wait includes each hand-over between the threads)")
    params = {k[len("params/"):]: v for k, v in trainer.adapter.state_dict().items()
              if k.startswith("params/")}
    text = sample(model, params, PROMPT, args.sample_bytes, args.seed)
    toolkit.print0(f"sample: {PROMPT}{text}")


def final_eval(trainer, tokens, context: int, windows: int, chunk: int = 2048,
               every_s: float = 5.0) -> float:
    """The validation loss over the first ``windows`` windows, evaluated ``chunk`` windows at
    a time (every rank the same chunks), rank 0 printing the progress every ``every_s``."""
    began = last = time.perf_counter()
    total = 0.0
    for first in range(0, windows, chunk):
        n = min(chunk, windows - first)
        part = toolkit.TokenWindows(tokens[first * context:(first + n) * context + 1], context)
        total += trainer.evaluate(part, log=False)["val_loss"] * n  # context tokens each
        now = time.perf_counter()
        if now - last >= every_s and first + n < windows:
            toolkit.print0(f"final eval {first + n:,}/{windows:,} windows, {now - began:.0f} s")
            last = now
    return total / windows


def sample(model, params, prompt: str, n: int, seed: int, temperature: float = 0.8) -> str:
    """Bytes drawn one at a time from the model (numpy forward: the same for every backend)."""
    params = {k: v.astype(np.float64) for k, v in params.items()}
    rng = np.random.default_rng(seed)
    ids = list(prompt.encode())
    for _ in range(n):
        logits = model.apply(params, np.asarray([ids[-model.context:]]))[0, -1] / temperature
        p = np.exp(logits - logits.max())
        ids.append(int(rng.choice(len(p), p=p / p.sum())))
    return bytes(ids[len(prompt.encode()):]).decode("utf-8", errors="replace")


if __name__ == "__main__":
    toolkit.run(main)

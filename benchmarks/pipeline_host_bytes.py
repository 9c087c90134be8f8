"""Bytes a Horovod pipeline step allocates on the host in numpy beside its gradient's bytes: the
gradient's trips through the host, counted on the CPU.

    .venv/bin/python benchmarks/pipeline_host_bytes.py --backend horovod-torch
    .venv/bin/horovodrun -np 2 --gloo .venv/bin/python benchmarks/pipeline_host_bytes.py \\
        --backend horovod-tf --layout pipeline:1:2

An MLP 256-1024-1024-10 under the pipeline layout, with ``--clip-grad-norm`` (so the update
measures and clips the whole gradient) and fp16-mixed's loss scaler with ``--precision
fp16-mixed``. After a warm-up step, ``tracemalloc`` follows one step per window: numpy's arrays
are traced (the framework's own tensors are not, nor are a round's activation messages in
horovod-torch), so the peak of traced bytes is what numpy held at once during the step. Rank 0
prints the median of ``--windows`` steps against the stage's gradient bytes. On a GPU every such
byte of gradient is a device-to-host copy and back; a step whose gradients stay on the device
holds none of them.
"""

import argparse
import statistics
import tracemalloc

import numpy as np

import adapters
import toolkit
from toolkit.launch.env import detect_launch_env

SIZES = (256, 1024, 1024, 10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="horovod-torch", choices=("horovod-torch", "horovod-tf"))
    p.add_argument("--layout", default="pipeline:1:2")
    p.add_argument("--precision", default="32", choices=("32", "fp16-mixed"))
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    env = detect_launch_env()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * 4, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], size=len(x)).astype(np.int64)
    trainer = toolkit.Trainer(adapters.get(args.backend, precision=args.precision),
                              toolkit.MLP(SIZES), toolkit.SGD(lr=0.01, momentum=0.9),
                              layout=args.layout, global_batch_size=args.batch,
                              clip_grad_norm=1.0, max_steps=1, progress=False, env=env)
    trainer.fit(x, y)  # (build, compile, warm up)
    strategy = trainer.adapter.strategy
    grad_bytes = strategy.memory_bytes()["grads"]
    local = args.batch // strategy.grid.replicas  # (a replica's share of the global batch)
    peaks = []
    for _ in range(args.windows):
        tracemalloc.start()
        strategy.train_step(x[:local], y[:local], 0.01)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    peak = statistics.median(peaks)
    toolkit.print0(f"{args.backend} {args.layout} {args.precision}: numpy held at most "
                   f"{peak / 1e6:.2f} MB during a step; the stage's gradient is "
                   f"{grad_bytes / 1e6:.2f} MB ({peak / grad_bytes:.2f}x)", env=env)


if __name__ == "__main__":
    main()

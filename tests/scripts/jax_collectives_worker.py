"""What jax-pjit's step program carries in its collectives, per precision, on one process of
``--devices`` CPU devices (tests/adapters/test_compute_gathers.py).

    python tests/scripts/jax_collectives_worker.py --devices 4 --layout sharded:3:tp2 --model gpt

Builds a Trainer for each precision, lowers the step program as the first step runs it, reads
its collectives after XLA's SPMD partitioning (``adapters._jax.hlo.partitioned_collectives``)
and prints one JSON line: ``{precision: {"<kind> <dtype>": bytes}}``.
"""

import argparse
import json
import os
import sys
import tempfile

p = argparse.ArgumentParser()
p.add_argument("--devices", type=int, default=4)
p.add_argument("--layout", required=True)
p.add_argument("--model", default="gpt")
args = p.parse_args()
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

import jax  # noqa: E402

import adapters  # noqa: E402
import toolkit  # noqa: E402
from adapters._jax.hlo import partitioned_collectives  # noqa: E402
from toolkit.equivalence import load_data, make_model  # noqa: E402

programs = {}
for precision in ("32", "bf16-mixed"):
    x, y = load_data(args.model, "float32")
    adapter = adapters.get("jax-pjit")
    trainer = toolkit.Trainer(adapter, make_model(args.model), toolkit.SGD(lr=0.1),
                              layout=args.layout, precision=precision, global_batch_size=16,
                              max_steps=0, seed=0, progress=False)
    trainer.fit(x, y)
    strategy = adapter.strategy
    run = strategy._run_step

    def spy(fn, step_args, precision=precision, run=run, **kw):
        if precision not in programs:
            shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=getattr(a, "sharding", None))
                if hasattr(a, "shape") else a, step_args)
            programs[precision] = {f"{kind} {dtype}": n for (kind, dtype), n in
                                   partitioned_collectives(fn.lower(*shapes),
                                                           tempfile.mkdtemp()).items()}
        return run(fn, step_args, **kw)

    strategy._run_step = spy
    trainer.max_steps = 1
    trainer.fit(x, y)
print(json.dumps(programs))
sys.stdout.flush()

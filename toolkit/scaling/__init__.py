"""A strong or weak scaling study of a training script: throughput, speed-up, efficiency and
where the step time goes, against the number of ranks, as a table and a PNG.

    python -m toolkit.scaling --script examples/train_gpt.py --world-sizes 1,2,4 \\
        --mode strong|weak [--launcher mpirun|horovodrun|srun] [--backend a,b,...] \\
        [--steps 30 --warmup 10] [--png scaling.png] -- SCRIPT_ARGS

Each world size runs the script with the launcher for ``--warmup`` + ``--steps`` steps, its
metrics log in ``--out-dir``; the throughput is that of the steps after the warm-up (the
``interval`` records when the log has them, else the step records' times). Strong scaling
keeps the global batch (the script's ``--batch-size``); weak scaling keeps the batch per rank,
the global batch growing with the world size. Speed-up is the throughput over that of the
smallest size (times that size), efficiency the speed-up over the world size: for weak
scaling, the throughput per rank relative to the smallest size's.

The step time is split into input wait (measured by the Trainer), compute (the step time of
one rank given the same batch per rank: a reference run per batch, skipped with
``--no-breakdown``) and the rest, communication and synchronisation (what N ranks add to that
one rank's step: collectives, waiting for the slowest rank, and on shared cores the ranks'
competition for them). A compiled step (XLA, ``tf.function``) fuses its collectives with its
compute, so the split is measured this way in every backend alike rather than by timers
inside the step.

Under ``srun`` inside an allocation of several nodes, the ranks fill one node before the next
(``--ranks-per-node``, else the allocation's cores per node) and the table and the picture
mark where the job first spans another node. A size that fails is reported in the table and
the study goes on; the exit status is non-zero only when every size failed. Several
``--backend`` values run one study each, drawn on one picture.
"""

from toolkit.scaling.cli import main, parse_args
from toolkit.scaling.report import draw, table
from toolkit.scaling.study import (
    Point,
    boundaries,
    fill_ratios,
    last_error,
    launch_command,
    measure,
    nodes_for,
    ranks_per_node,
    run_study,
)

__all__ = ["Point", "boundaries", "draw", "fill_ratios", "launch_command", "last_error",
           "main", "measure", "nodes_for", "parse_args", "ranks_per_node", "run_study",
           "table"]

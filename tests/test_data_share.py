"""Each process trains on exactly the samples its position in the layout calls for.

Not only the final losses: every step, what each rank's devices actually hold (the arrays the
backend trains on, read back shard by shard) is checked against the sampler's published
partition, for every layout and every split of devices into processes the backends run. A
tensor-parallel group that spans processes must feed the same samples on each of them (one
model replica); a pipeline's stages share their replica's samples.
"""

from collections import Counter, defaultdict

import pytest

# (backend, processes, devices per process, layouts with the number of data shares each
# should have: processes / (processes per replica)). The four-process runs of horovod-tf and
# jax-pjit run with `make test-long` (on this 2-core machine they take 25-30 s each; horovod-tf
# on two processes and jax-pjit's model axis across processes stay in `make test`).
CONFIGS = [
    # (Horovod fixes its process sets when it starts: the pipeline runs first)
    ("horovod-torch", 4, None, {"pipeline:2:2": 2, "data": 4, "sharded:2": 4}),
    ("horovod-tf", 2, None, {"pipeline:2:2": 1, "data": 2, "sharded:3": 2}),
    ("horovod-tf", 4, None, {"pipeline:2:2": 2, "data": 4, "sharded:3": 4}),
    ("jax-pmap", 2, 1, {"data": 2, "sharded:3": 2, "pipeline:2:2": 1}),
    ("jax-pmap", 2, 2, {"data": 2, "sharded:2": 2}),
    # one device per process: a model axis of 2 spans both processes (one replica)
    ("jax-pjit", 2, 1, {"data": 2, "sharded:3": 2, "sharded:3:tp2": 1, "pipeline:2:2": 1}),
    # two devices per process: tp2 inside each process, tp4 over both
    ("jax-pjit", 2, 2, {"data": 2, "sharded:3:tp2": 2, "sharded:3:tp4": 1}),
    ("jax-pjit", 4, 1, {"sharded:3:tp2": 2, "sharded:3:tp4": 1, "pipeline:2:2": 2}),
]
LONG = {("horovod-tf", 4), ("jax-pjit", 4)}
PARAMS = [pytest.param(*c, id=f"{c[0]}-{c[1]}x{c[2] or 1}",
                       marks=[pytest.mark.long] if c[:2] in LONG else []) for c in CONFIGS]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "nproc", "devices", "layouts"), PARAMS)
def test_every_rank_trains_on_the_samples_its_position_calls_for(launch, backend, nproc,
                                                                 devices, layouts):
    argv = ["tests/scripts/data_share_worker.py", backend, ",".join(layouts)]
    if devices:
        argv += ["--local-devices", str(devices)]
    job = launch("any", nproc, argv, timeout=400)
    assert job.returncode == 0, job
    assert sorted(job.results_by_rank) == list(range(nproc)), job
    records = defaultdict(dict)  # (layout, step) -> {rank: record}
    for rank, rows in job.results_by_rank.items():
        for r in rows:
            records[(r["layout"], r["step"])][rank] = r
    assert {layout for layout, _ in records} == set(layouts), job
    for (layout, step), by_rank in records.items():
        where = f"{backend} {nproc}x{devices or 1} {layout} step {step}"
        batch = by_rank[0]["global"]
        assert len(batch) == 16 and all(r["global"] == batch for r in by_rank.values()), where
        shares = {r["share"][1] for r in by_rank.values()}
        assert {r["share"][0] for r in by_rank.values()} == {layouts[layout]}, where
        assert shares == set(range(layouts[layout])), where
        for rank, r in by_rank.items():
            # what its devices hold is exactly its share of the sampler's global batch
            assert r["consumed"] == r["expected"], (where, rank)
        holders = defaultdict(list)  # the same piece of one array holds the same samples
        for r in by_rank.values():
            for start, stop, ids in r["pieces"]:
                key = (start, stop) if r["global_array"] else r["share"][1]
                holders[key].append(ids)
        for key, copies in holders.items():
            assert all(c == copies[0] for c in copies), (where, key, copies)
        # the distinct pieces cover the global batch exactly once
        assert Counter(i for copies in holders.values() for i in copies[0]) == Counter(batch), \
            where
        if by_rank[0]["global_array"]:
            bounds = sorted(holders)
            assert bounds[0][0] == 0 and bounds[-1][1] == len(batch), (where, bounds)
            assert all(a[1] == b[0] for a, b in zip(bounds[:-1], bounds[1:], strict=True)), \
                (where, bounds)

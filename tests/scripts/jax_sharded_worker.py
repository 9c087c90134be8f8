"""Started on 2 processes x 2 CPU devices by tests/adapters/test_sharded_jax.py.

1. The collectives the JAX sharded layouts use, against numpy, with per-device chunks of 1.1 MiB
   and 4.4 MiB (a tail corruption at 4 MiB chunks was reported: jax issue 40830): jax-pmap's
   ``lax.psum_scatter`` / ``lax.all_gather``, and jax-pjit's compiler-inserted reduce-scatter
   (a sum constrained to ``P("data")``) and all-gather (a sharded array made replicated).
2. A stage-3 run's checkpoint pieces: each process's piece of every tensor is its devices'
   consecutive shards (``FlatLayout.owned``), padding excluded.
Prints one ``ok <check>`` line per check; any mismatch raises.
"""

import numpy as np

import adapters
import toolkit
from toolkit.parallel.shards import unit_layouts


def inputs(device: int, n: int) -> np.ndarray:
    return np.random.default_rng(device).standard_normal(n).astype(np.float32)


def check_pmap(jax, chunk: int) -> None:
    lax, n, local = jax.lax, jax.device_count(), jax.local_devices()
    first = jax.process_index() * len(local)
    mine = np.stack([inputs(first + i, n * chunk) for i in range(len(local))])
    every = np.stack([inputs(d, n * chunk) for d in range(n)])

    def collectives(x):
        scattered = lax.psum_scatter(x, "batch", tiled=True)
        return scattered, lax.all_gather(scattered, "batch", tiled=True)

    scattered, gathered = jax.pmap(collectives, axis_name="batch")(mine)
    total = every.astype(np.float64).sum(axis=0)
    for i in range(len(local)):
        d = first + i
        np.testing.assert_allclose(scattered[i], total[d * chunk:(d + 1) * chunk], rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(gathered[i], total, rtol=1e-5, atol=1e-5)
    print(f"ok pmap psum_scatter+all_gather {chunk * 4 / 2**20:.1f} MiB per device", flush=True)


def check_pjit(jax, chunk: int) -> None:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n = jax.device_count()
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    rows, flat = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())
    every = np.stack([inputs(d, n * chunk) for d in range(n)])
    x = jax.make_array_from_callback(every.shape, rows, lambda idx: every[idx])

    def collectives(x):  # each device's row summed, the sum cut over the devices, re-gathered
        scattered = jax.lax.with_sharding_constraint(x.sum(axis=0), rows)
        return scattered, jax.lax.with_sharding_constraint(scattered * 1.0, flat)

    scattered, gathered = jax.jit(collectives, out_shardings=(rows, flat))(x)
    total = every.astype(np.float64).sum(axis=0)
    for shard in scattered.addressable_shards:
        np.testing.assert_allclose(shard.data, total[shard.index], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gathered.addressable_data(0), total, rtol=1e-5, atol=1e-5)
    print(f"ok pjit reduce-scatter+all-gather {chunk * 4 / 2**20:.1f} MiB per device",
          flush=True)


def check_pieces(adapter, env) -> None:
    """Stage 3 on an MLP whose units do not divide by 4 devices: padding in the last shards."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 5)).astype(np.float32), rng.integers(0, 3, 64)
    model = toolkit.MLP((5, 6, 3))
    trainer = toolkit.Trainer(adapter, model, toolkit.Adam(lr=1e-2), global_batch_size=16,
                              max_steps=2, progress=False, layout=toolkit.Sharded(stage=3))
    trainer.fit(x, y)
    full = adapter.state_dict()
    replicated, pieces = adapter.sharded_state()
    assert set(replicated) == {"opt/count"}, sorted(replicated)
    n, local = adapter.runtime.jax.device_count(), adapter.runtime.jax.local_device_count()
    layouts = unit_layouts({k: v.shape for k, v in model.init(0).items()}, n)
    expected = {}
    for layout in layouts.values():
        for device in range(env.rank * local, (env.rank + 1) * local):
            for name, a, b, _ in layout.owned(device):
                for prefix in ("params", "opt/mu", "opt/nu"):
                    piece = full[f"{prefix}/{name}"].reshape(-1)[a:b]
                    expected.setdefault(f"{prefix}/{name}", []).append(piece)
    assert set(pieces) == {f"{p}/{k}" for p in ("params", "opt/mu", "opt/nu")
                           for k in model.init(0)}, sorted(pieces)
    for name, (piece, axis, shape) in pieces.items():
        want = np.concatenate(expected.get(name, [np.zeros(0, np.float32)]))
        assert axis == 0 and tuple(shape) == full[name].shape, (name, axis, shape)
        np.testing.assert_array_equal(piece, want, err_msg=name)
    print(f"ok stage-3 pieces of rank {env.rank}", flush=True)


def main() -> None:
    env = toolkit.current_env()
    adapter = adapters.get("jax-pmap", local_devices=2)
    adapter.setup(env)
    jax = adapter.runtime.jax
    assert jax.device_count() == 2 * env.world_size, jax.devices()
    for mib in (1.1, 4.4):
        chunk = int(mib * 2**20 / 4)
        check_pmap(jax, chunk)
        check_pjit(jax, chunk)
    check_pieces(adapter, env)
    adapter.shutdown()


if __name__ == "__main__":
    toolkit.run(main)

"""horovod-torch's device plumbing that the CPU can check: a pipeline stage's pieces move to
their device in place (the ``meta`` device stands in for a GPU: it holds shapes, not values),
and a checkpoint's step count comes back as the optimizer keeps it."""

import torch

import toolkit
from adapters.horovod_torch.ops import count_like
from adapters.horovod_torch.stages import cut_model


def test_a_stage_reads_its_buffers_again_after_they_moved():
    """``Module.to`` puts new buffer tensors in the modules; the stage's catalogue (what
    checkpoints and ``sync_state`` read and write) must name those, not the old ones. Stage 0
    here holds buffers only (the meta device takes no in-place move of a CPU parameter)."""
    norm = torch.nn.BatchNorm1d(4, affine=False)
    net = torch.nn.Sequential(norm, torch.nn.Linear(4, 2))
    before = [id(b) for b in norm.buffers()]
    cut = cut_model(torch, net, toolkit.parse_layout("pipeline:2:2"), 0, torch.float32,
                    torch.device("meta"))
    assert [n for n, _ in cut.buffers] == ["0.running_mean", "0.running_var",
                                           "0.num_batches_tracked"]
    now = dict(norm.named_buffers())
    assert all(b is now[n[2:]] and b.device.type == "meta" for n, b in cut.buffers)
    assert not {id(b) for _, b in cut.buffers} & set(before)  # (they did move)
    assert all(p.device.type == "cpu" for p in net[1].parameters())  # stage 1's stay


def test_a_stage_on_its_own_device_keeps_every_tensor():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Linear(8, 2))
    params = {id(p) for p in net.parameters()}
    cut = cut_model(torch, net, toolkit.parse_layout("pipeline:2:2"), 0, torch.float32,
                    torch.device("cpu"))
    assert cut.params() and all(id(p) in params for _, p, _, _ in cut.params())
    assert {id(b) for _, b in cut.buffers} <= {id(b) for b in net.buffers()}


def test_a_resumed_step_count_keeps_the_optimizer_s_kind_of_count():
    old = torch.tensor(0.0, dtype=torch.float32)
    new = count_like(torch, old, 7)
    assert torch.is_tensor(new) and new.dtype == old.dtype and float(new) == 7.0
    assert count_like(torch, 0, 7) == 7 and type(count_like(torch, 0, 7)) is int  # SparseAdam


def test_a_round_packed_as_tensors_is_the_host_packing_and_unpacks_the_same():
    """horovod-torch packs a pipeline round's messages on the rank's device (a GPU's then go
    through NCCL) exactly as the host packing does, and ``unpack`` reads both alike."""
    import numpy as np

    from adapters._horovod.rounds import pack, unpack
    from adapters.horovod_torch.pipeline import pack_tensors

    g = torch.Generator().manual_seed(0)
    outgoing = {3: [torch.randn(2, 5, generator=g), torch.randn(4, generator=g)],
                1: [torch.randn(3, 2, 2, generator=g, dtype=torch.float64)]}
    buf, splits = pack_tensors(torch, outgoing, 4, torch.float32, torch.device("cpu"))
    host, host_splits = pack({r: [t.numpy() for t in ts] for r, ts in outgoing.items()}, 4,
                             np.float32)
    assert splits == host_splits == [0, 1 + 3 + 12, 0, (1 + 2 + 10) + (1 + 1 + 4)]
    assert buf.dtype == torch.float32 and np.array_equal(buf.numpy(), host)
    ends = np.cumsum(splits)
    part = buf[ends[3] - splits[3]:ends[3]]
    first, offset = unpack(part, 0)
    second, end = unpack(part, offset)
    assert torch.equal(first, outgoing[3][0]) and torch.equal(second, outgoing[3][1])
    assert end == splits[3] and torch.is_tensor(first)
    empty, none = pack_tensors(torch, {}, 2, torch.float32, torch.device("cpu"))
    assert empty.numel() == 0 and none == [0, 0]

"""The device option and the local-rank -> GPU mapping (framework-free)."""

import pytest

from toolkit import LaunchEnv, ToolkitError
from toolkit.launch.devices import Device, choose_device, count_gpus, one_gpu_per_task

NO_SLURM: dict = {}


def test_cpu_is_the_cpu_whatever_the_node_has():
    assert choose_device("cpu", 8, 3, 4, NO_SLURM) == Device("cpu")
    assert str(Device("cpu")) == "cpu" and str(Device("gpu", 2)) == "gpu:2"


def test_auto_takes_the_gpu_of_the_local_rank_when_there_is_one():
    assert choose_device("auto", 0, 0, 1, NO_SLURM) == Device("cpu")
    assert choose_device("auto", 0, 1, 2, NO_SLURM) == Device("cpu")
    for local_rank in range(4):
        assert choose_device("auto", 4, local_rank, 4, NO_SLURM) == Device("gpu", local_rank)
    # a node with more GPUs than ranks: each rank still takes its own, by local rank
    assert [choose_device("gpu", 8, r, 2, NO_SLURM).index for r in range(2)] == [0, 1]


def test_gpu_without_one_is_refused_naming_what_the_rank_sees():
    with pytest.raises(ToolkitError, match="local rank 1 sees no GPU") as err:
        choose_device("gpu", 0, 1, 2, {"CUDA_VISIBLE_DEVICES": ""})
    assert "(CUDA_VISIBLE_DEVICES='')" in str(err.value)
    assert "HINT: run on a node with GPUs (e.g. sbatch --gres=gpu:N)" in str(err.value)
    with pytest.raises(ToolkitError) as err:
        choose_device("gpu", 0, 0, 1, NO_SLURM)
    assert "CUDA_VISIBLE_DEVICES" not in str(err.value).split("\n")[0]


def test_more_ranks_than_gpus_on_a_node_is_refused_naming_both_numbers():
    with pytest.raises(ToolkitError) as err:
        choose_device("auto", 2, 3, 4, NO_SLURM)
    first, hint = str(err.value).split("\nHINT: ")
    assert first.endswith("4 ranks run on this node but it has 2 visible GPU(s): local rank 3 "
                          "has no GPU of its own")
    assert hint == ("launch at most 2 rank(s) per node (srun --ntasks-per-node=2, mpirun "
                    "-npernode 2), give each task its own GPU (srun --gpus-per-task=1), or "
                    "request 4 GPUs per node (--gres=gpu:4); TOOLKIT_SHARE_GPUS=1 lets ranks "
                    "share GPUs where collectives go through host memory (a Horovod built "
                    "without NCCL)")
    with pytest.raises(ToolkitError, match="2 ranks run on this node but it has 1 visible"):
        choose_device("gpu", 1, 0, 2, NO_SLURM)  # two ranks would share one GPU


def test_ranks_share_the_gpus_only_when_told_to():
    shared = {"TOOLKIT_SHARE_GPUS": "1"}
    assert [choose_device("gpu", 2, r, 4, shared).index for r in range(4)] == [0, 1, 0, 1]
    assert choose_device("auto", 1, 1, 2, shared) == Device("gpu", 0)
    assert choose_device("auto", 0, 1, 2, shared) == Device("cpu")  # nothing to share
    assert choose_device("gpu", 4, 3, 4, shared) == Device("gpu", 3)  # enough: unchanged
    with pytest.raises(ToolkitError, match="2 ranks run on this node"):
        choose_device("gpu", 1, 1, 2, {"TOOLKIT_SHARE_GPUS": "0"})
    with pytest.raises(ToolkitError, match="TOOLKIT_SHARE_GPUS='yes' is not 0 or 1"):
        choose_device("gpu", 1, 1, 2, {"TOOLKIT_SHARE_GPUS": "yes"})


def test_a_gpu_per_task_from_slurm_is_the_task_s_only_visible_gpu():
    bound = {"SLURM_GPUS_PER_TASK": "1"}
    assert one_gpu_per_task(bound) and one_gpu_per_task({"SLURM_GPUS_PER_TASK": "a100:1"})
    assert one_gpu_per_task({"SLURM_GPU_BIND": "verbose,single:1"})
    assert not one_gpu_per_task({"SLURM_GPUS_PER_TASK": "2"}) and not one_gpu_per_task({})
    assert [choose_device("gpu", 1, r, 4, bound) for r in range(4)] == [Device("gpu", 0)] * 4


def test_an_unknown_device_names_the_choices():
    with pytest.raises(ToolkitError, match="device") as err:
        choose_device("cuda", 1, 0, 1, NO_SLURM)
    assert "'cuda'" in str(err.value) and "auto" in str(err.value) and "gpu" in str(err.value)


@pytest.mark.gpu
def test_the_mapping_takes_a_gpu_torch_sees():
    import torch

    count = torch.cuda.device_count()
    device = choose_device("auto", count, 0, 1, NO_SLURM)
    assert device == Device("gpu", 0)
    x = torch.arange(4.0, device=f"cuda:{device.index}")
    assert x.device.type == "cuda" and float((x * 2).sum().cpu()) == 12.0


def test_gpus_are_counted_without_a_framework(tmp_path):
    """CUDA_VISIBLE_DEVICES decides when set; else the driver's /dev/nvidiaN files (not
    nvidiactl, nvidia-uvm, ...)."""
    for name in ("nvidia0", "nvidia1", "nvidia7", "nvidiactl", "nvidia-uvm", "nvidia-modeset"):
        (tmp_path / name).touch()
    assert count_gpus({}, tmp_path) == 3
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "1"}, tmp_path) == 1
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "GPU-5a1b,GPU-77c2"}, tmp_path) == 2
    for hidden in ("", " ", "-1", "NoDevFiles"):
        assert count_gpus({"CUDA_VISIBLE_DEVICES": hidden}, tmp_path) == 0
    assert count_gpus({}, tmp_path / "missing") == 0


def test_a_jax_process_per_gpu_is_given_its_local_rank_s_gpu():
    from adapters._jax.runtime import local_device_ids

    per_gpu = LaunchEnv(rank=5, world_size=8, local_rank=1, local_size=4, launcher="srun")
    assert local_device_ids(Device("gpu", 1), per_gpu) == [1]
    per_node = LaunchEnv(rank=1, world_size=2, local_rank=0, local_size=1, launcher="srun")
    assert local_device_ids(Device("gpu", 0), per_node) is None  # all the node's GPUs
    assert local_device_ids(Device("cpu"), per_gpu) is None


def test_the_trainer_checks_the_device_option():
    import adapters
    import toolkit

    with pytest.raises(ToolkitError, match="unknown device 'cuda'") as err:
        toolkit.Trainer(adapters.get("jax-pjit"), toolkit.MLP((4, 2)), toolkit.SGD(lr=0.1),
                        global_batch_size=4, device="cuda")
    assert err.value.hint == "use one of: auto, cpu, gpu"

"""Model FLOPs per training sample of the spec models, and the peak FLOP/s of the GPUs users
train on: the two halves of the model FLOPs utilisation (MFU) the Trainer reports.

A training step costs about three forward passes (the backward pass computes the gradients
of the activations and of the weights, each as costly as the forward), and a multiply-add is
two FLOPs. Element-wise work (biases, activations, softmax, layer norms) is not counted, as
in the PaLM paper's MFU and in nanoGPT's ``estimate_mfu``.

    >>> from toolkit.models.specs import MLP
    >>> training_flops_per_sample(MLP((64, 128, 10)))  # 3 x 2 x (64*128 + 128*10)
    56832.0
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Dense peak FLOP/s of one GPU by the precision of its matrix products, without sparsity.
# NVIDIA's data sheets: "NVIDIA H100 Tensor Core GPU" (SXM column: FP32 67 TFLOPS, TF32
# 494.7, BF16/FP16 989.4 dense, half the "with sparsity" figures), "NVIDIA H200" (the same
# compute as the H100 SXM), "NVIDIA A100 Tensor Core GPU" (FP32 19.5, TF32 156, BF16/FP16
# 312), "NVIDIA V100 Tensor Core GPU" (SXM2: FP32 15.7, FP16 tensor 125; no bfloat16).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12},
    "H100": {"float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12},
    "A100": {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
    "V100": {"float32": 15.7e12, "float16": 125e12},
}


def training_flops_per_sample(model: Any) -> float | None:
    """Forward and backward FLOPs of one sample of a spec model (``MLP``, ``CNN``, ``GPT``);
    None for any other model (a native model: its FLOPs are the user's to give).

    MLP: 3 x 2 x the multiply-adds of its dense layers. CNN: the same with each k x k
    convolution's ``H x W x k x k x C_in x C_out`` multiply-adds (stride 1, SAME padding: the
    padded border is computed too) and the dense head's. GPT: per token, 6 x its parameters
    plus 12 x layers x width x context for the attention's scores and weighted sums (the PaLM
    paper's count, appendix B), times the context for a sample of ``context`` tokens.
    """
    kind = type(model).__name__
    if kind == "MLP":
        return 6.0 * sum(a * b for a, b in zip(model.sizes[:-1], model.sizes[1:], strict=True))
    if kind == "CNN":
        h, w, c = model.image_shape
        k, macs = model.kernel_size, 0
        for out in model.channels:
            macs += h * w * k * k * c * out
            c = out
        return 6.0 * (macs + h * w * c * model.classes)
    if kind == "GPT":
        return gpt_flops_per_token(model) * model.context
    return None


def gpt_flops_per_token(spec: Any) -> float:
    """Training FLOPs per token of a GPT spec: 6 x parameters (all of them, embeddings
    included) + 12 x layers x width x context (PaLM, appendix B; nanoGPT's ``estimate_mfu``)."""
    return 6.0 * spec.num_params + 12.0 * spec.layers * spec.width * spec.context


def peak_flops(gpu_name: str, precision: str) -> float | None:
    """The dense peak FLOP/s of the GPU called ``gpu_name`` (``"NVIDIA H100 80GB HBM3"``) for
    matrix products in ``precision`` (``float32``, ``tf32``, ``bfloat16``, ``float16``); None
    when the table does not know the GPU or the precision.

        >>> peak_flops("NVIDIA A100-SXM4-40GB", "bfloat16")
        312000000000000.0
        >>> peak_flops("Tesla T4", "float32") is None
        True
    """
    for model, peaks in PEAK_FLOPS.items():
        if model in gpu_name.upper():
            return peaks.get(precision)
    return None


def gpu_models(proc: str | os.PathLike = "/proc/driver/nvidia/gpus") -> list[str]:
    """The model names of this node's NVIDIA GPUs as the driver lists them (no framework
    needed); empty without a driver."""
    names = []
    try:
        entries = sorted(Path(proc).iterdir())
    except OSError:
        return []
    for entry in entries:
        try:
            text = (entry / "information").read_text()
        except OSError:
            continue
        found = re.search(r"^Model:\s*(.+)$", text, re.MULTILINE)
        if found:
            names.append(found.group(1).strip())
    return names


def device_peak(device_names: Iterable[str], compute_dtype: str,
                models: list[str] | None = None) -> tuple[float | None, str]:
    """The peak FLOP/s of one of this process's devices (named as the adapter names them,
    ``cuda:0``, ``gpu:0``, ``cpu``) computing in ``compute_dtype``, and what it is (or why
    there is none). The node's GPUs must all be one model the table knows."""
    names = list(device_names)
    if not any(re.search(r"cuda|gpu", n, re.IGNORECASE) for n in names):
        return None, (f"no GPU among this process's devices ({', '.join(names) or 'none named'})"
                      ": pass --peak-flops (per device) for an MFU")
    models = gpu_models() if models is None else models
    if len(set(models)) != 1:
        return None, ("the GPUs' model is unknown" if not models else
                      f"this node has GPUs of several models ({', '.join(sorted(set(models)))})"
                      ) + ": pass --peak-flops (per device) for an MFU"
    peak = peak_flops(models[0], compute_dtype)
    if peak is None:
        return None, (f"no peak FLOP/s known for {models[0]} in {compute_dtype}: pass "
                      "--peak-flops (the data sheet's dense figure) for an MFU")
    return peak, f"{models[0]}, {peak / 1e12:g} TFLOP/s {compute_dtype} dense (data sheet)"


def check_flops(name: str, value: Any) -> float | None:
    """``value`` (``peak_flops``, ``flops_per_sample``) as a positive float, None for None."""
    from toolkit.errors import ToolkitError

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise ToolkitError(f"{name}={value!r} is not a positive number of FLOPs",
                           "e.g. 989e12 for an H100's bfloat16 peak (per device); leave it "
                           "out to use the table of known GPUs")
    return float(value)

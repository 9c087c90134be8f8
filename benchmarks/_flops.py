"""Model FLOPs per token of a GPT and the peak FLOP/s of the GPUs users train on, for the
model FLOPs utilisation (MFU) the GPU benchmarks print."""

# Dense peak FLOP/s by matmul precision (NVIDIA's data sheets; SXM parts, no sparsity).
PEAKS = {
    "H200": {"float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12},
    "H100": {"float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12},
    "A100": {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12},
    "V100": {"float32": 15.7e12, "tf32": 15.7e12, "bfloat16": 125e12},
}


def flops_per_token(spec) -> float:
    """Training FLOPs per token: 6 per parameter (forward, and twice that backward) plus the
    attention's scores and weighted sums, 12 x layers x width x context (PaLM, appendix B;
    nanoGPT's ``estimate_mfu``)."""
    return 6.0 * spec.num_params + 12.0 * spec.layers * spec.width * spec.context


def peak_flops(gpu_name: str, precision: str) -> float:
    """The peak of the GPU called ``gpu_name`` (as the framework names it) at ``precision``."""
    for model, peaks in PEAKS.items():
        if model in gpu_name.upper():
            return peaks[precision]
    raise SystemExit(f"no peak FLOP/s known for the GPU {gpu_name!r}: pass --peak-tflops "
                     "(the data sheet's dense figure for the matmul precision)")

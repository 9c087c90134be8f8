"""Backend adapters, one module per framework, each importing its framework only when chosen.

>>> import adapters
>>> adapters.BACKENDS
('horovod-torch', 'horovod-tf', 'jax-pmap', 'jax-pjit')
"""

from __future__ import annotations

import importlib

from toolkit import Adapter, ToolkitError

# name -> (module, class) implementing it; the module is imported only when chosen
_REGISTRY: dict[str, tuple[str, str] | None] = {
    "horovod-torch": ("adapters.horovod_torch", "HorovodTorchAdapter"),
    "horovod-tf": ("adapters.horovod_tf", "HorovodTFAdapter"),
    "jax-pmap": ("adapters.jax_pmap", "JaxPmapAdapter"),
    "jax-pjit": ("adapters.jax_pjit", "JaxPjitAdapter"),
}
BACKENDS = tuple(_REGISTRY)
IMPLEMENTED = tuple(name for name, module in _REGISTRY.items() if module)


def get(name: str, *, dtype: str | None = None, precision: str | None = None,
        local_devices: int | None = None, compression: str | None = None) -> Adapter:
    """The adapter for backend ``name``; its framework is imported when it is set up.

    Args:
        name: one of :data:`BACKENDS`.
        dtype: ``float32`` or ``float64`` parameters (None: the precision's, else float32).
        precision: a policy of ``toolkit.precision`` (``"32"``, ``"64"``, ``"bf16-mixed"``,
            ``"fp16-mixed"``); None: the plain one of ``dtype``.
        local_devices: JAX backends only: CPU devices per process (``jax_num_cpu_devices``);
            None keeps JAX's own count.
        compression: Horovod backends only: ``"fp16"`` sends the data-parallel gradient
            allreduce in float16 (``hvd.Compression.fp16``); None or ``"none"``: as computed.

    Raises:
        ToolkitError: for an unknown name (listing the valid ones) or one not implemented yet.
    """
    if name not in _REGISTRY:
        raise ToolkitError(f"unknown backend {name!r}",
                           f"valid backends: {', '.join(BACKENDS)}")
    entry = _REGISTRY[name]
    if entry is None:
        raise ToolkitError(f"backend {name!r} is not implemented yet",
                           f"implemented backends: {', '.join(IMPLEMENTED)}")
    options = {} if local_devices is None else {"local_devices": local_devices}
    if options and not name.startswith("jax-"):
        raise ToolkitError(f"local_devices={local_devices} applies to the JAX backends only",
                           f"drop it for {name!r} (one device per process)")
    if compression is not None:
        if not name.startswith("horovod-"):
            raise ToolkitError(f"compression={compression!r} applies to the Horovod backends only",
                               f"drop it for {name!r}, or use --precision bf16-mixed to halve "
                               "the activations' bytes")
        options["compression"] = compression
    module, cls = entry
    return getattr(importlib.import_module(module), cls)(dtype=dtype, precision=precision,
                                                         **options)

"""The toolkit's GPT as Hugging Face's GPT-2, and back: by renaming alone.

``toolkit.GPT`` is GPT-2's architecture (pre-LayerNorm with eps 1e-5, learned positions, the
tanh GELU, a 4x MLP, a head tied to the token embedding), and its kernels are ``(in, out)`` as
GPT-2's ``Conv1D`` keeps them, with ``qkv``'s columns ``[q | k | v]`` (heads in order), as
``c_attn`` splits them. So a checkpoint maps onto ``GPT2LMHeadModel`` tensor for tensor:

- :func:`save_pretrained` writes ``model.safetensors`` and ``config.json`` that
  ``GPT2LMHeadModel.from_pretrained(dir)`` loads (offline);
- :func:`read_config` and :func:`read_params` read such a directory back: the GPT's sizes,
  and its parameters by neutral name. ``toolkit.GPT.from_pretrained(dir)`` is the spec they
  describe, whose ``init`` returns those parameters, to fine-tune a GPT-2 checkpoint with any
  backend and layout.

None of them needs ``transformers``: the files are written and read with numpy (the
safetensors format is a JSON header and the raw little-endian arrays). This module knows
GPT-2's files, not the ``GPT`` class (a spec here is anything with its fields), so that
``gpt.py`` can read a directory for ``GPT.init`` without this module importing it back.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.errors import ToolkitError

_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16}
_CODES = {np.dtype(v).name: k for k, v in _DTYPES.items()}
_BLOCK = {"ln1.scale": "ln_1.weight", "ln1.bias": "ln_1.bias",
          "attn.qkv.kernel": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
          "attn.proj.kernel": "attn.c_proj.weight", "attn.proj.bias": "attn.c_proj.bias",
          "ln2.scale": "ln_2.weight", "ln2.bias": "ln_2.bias",
          "mlp.fc.kernel": "mlp.c_fc.weight", "mlp.fc.bias": "mlp.c_fc.bias",
          "mlp.proj.kernel": "mlp.c_proj.weight", "mlp.proj.bias": "mlp.c_proj.bias"}


def hf_name(name: str) -> str:
    """A neutral GPT parameter name -> GPT-2's (``blocks.0.attn.qkv.kernel`` ->
    ``transformer.h.0.attn.c_attn.weight``)."""
    fixed = {"tok_emb": "transformer.wte.weight", "pos_emb": "transformer.wpe.weight",
             "ln_f.scale": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias",
             "head.kernel": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    _, index, rest = name.split(".", 2)
    return f"transformer.h.{index}.{_BLOCK[rest]}"


def config(spec: Any) -> dict[str, Any]:
    """GPT-2's ``config.json`` for ``spec`` (no dropout, as the toolkit's GPT).

    No special tokens: the toolkit's GPT has none (its vocabulary is bytes, or whatever the
    data holds), and GPT-2's defaults (50256) lie outside a smaller vocabulary.
    """
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": spec.vocab, "n_positions": spec.context, "n_embd": spec.width,
            "n_layer": spec.layers, "n_head": spec.heads, "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "initializer_range": 0.02, "scale_attn_weights": True, "use_cache": True,
            "tie_word_embeddings": spec.tied,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def save_pretrained(spec: Any, params: dict[str, np.ndarray], out: str | os.PathLike) -> Path:
    """Writes ``out/model.safetensors`` and ``out/config.json`` for ``GPT2LMHeadModel``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in params.items():
        value = np.asarray(value)
        tensors[hf_name(name)] = value.T if name == "head.kernel" else value  # Linear: (out, in)
    _write_safetensors(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config(spec), indent=2) + "\n")
    return out


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``toolkit.GPT`` fields (``vocab``, ``context``, ``width``, ``layers``, ``heads``,
    ``tied``) of a GPT-2 directory (``config.json`` + ``model.safetensors``).

    Raises:
        ToolkitError: the directory lacks a file, or its model is not GPT-2's architecture as
            the toolkit's GPT has it (another activation, a separate attention bias...).
    """
    directory = Path(directory)
    for name in ("config.json", "model.safetensors"):
        if not (directory / name).is_file():
            raise ToolkitError(f"{directory / name} does not exist",
                               "point at a GPT-2 directory saved by save_pretrained(...) "
                               "(config.json and model.safetensors)")
    cfg = json.loads((directory / "config.json").read_text())
    if cfg.get("model_type") != "gpt2" or cfg.get("activation_function", "gelu_new") not in (
            "gelu_new", "gelu_pytorch_tanh"):
        raise ToolkitError(f"{directory} holds a {cfg.get('model_type')!r} model with "
                           f"activation {cfg.get('activation_function')!r}",
                           "only GPT-2 (model_type 'gpt2', the tanh GELU) maps onto toolkit.GPT")
    return {"vocab": cfg["vocab_size"], "context": cfg["n_positions"], "width": cfg["n_embd"],
            "layers": cfg["n_layer"], "heads": cfg["n_head"],
            "tied": bool(cfg.get("tie_word_embeddings", True))}


def read_params(directory: str | os.PathLike, shapes: dict[str, tuple[int, ...]],
                dtype: str = "float32") -> dict[str, np.ndarray]:
    """A GPT-2 directory's ``model.safetensors`` as ``dtype`` arrays by neutral name, each
    checked against ``shapes`` (the spec's ``param_shapes()``)."""
    directory = Path(directory)
    tensors = _read_safetensors(directory / "model.safetensors")
    params = {}
    for name, shape in shapes.items():
        key = hf_name(name)
        if key not in tensors and key.startswith("transformer."):
            key = key[len("transformer."):]  # saved from GPT2Model, without the prefix
        if key not in tensors:
            raise ToolkitError(f"{directory / 'model.safetensors'} has no {hf_name(name)}",
                               "save the model with GPT2LMHeadModel.save_pretrained")
        value = tensors[key].T if name == "head.kernel" else tensors[key]
        if value.shape != shape:
            raise ToolkitError(f"{hf_name(name)} has shape {value.shape}, not {shape}",
                               "the config.json and the tensors disagree")
        params[name] = np.ascontiguousarray(value, dtype=dtype)
    return params


def _write_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype.name not in _CODES:
            raise ToolkitError(f"{name} has dtype {a.dtype}", "export float16/32/64 tensors")
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _CODES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    start, out = 8 + length, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ToolkitError(f"{path}: {name} has dtype {info['dtype']}",
                               "convert the checkpoint to float32 first")
        a, b = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
        out[name] = np.frombuffer(raw[start + a:start + b], dtype).reshape(info["shape"])
    return out

"""Export a checkpoint's weights to a framework's native form.

    python -m adapters.export CHECKPOINT --format torch --out model.pt
    python -m adapters.export CHECKPOINT --format tf    --out tf_ckpt/model
    python -m adapters.export CHECKPOINT --format orbax --out /abs/path/orbax_dir
    python -m adapters.export CHECKPOINT --format hf    --out gpt2_dir      (a toolkit.GPT)

CHECKPOINT is a run's checkpoint directory (the Trainer's ``checkpoint_dir``: its newest intact
checkpoint), its ``latest`` (the same) or one ``step_*`` directory in it.

- ``torch``: a ``state_dict`` file (``torch.load``); for spec models it is the state_dict of
  the same ``nn.Module`` the horovod-torch backend builds, which :func:`torch_module` builds
  for you: ``torch_module(spec).load_state_dict(torch.load(path))``. The MLP and CNN are
  ``nn.Linear``/``nn.Conv2d`` layers (``weight`` (out, in), OIHW); the GPT keeps GPT-2's
  Conv1D convention, ``kernel`` (in, out), under the spec's names
  (``blocks.0.attn.qkv.kernel``, LayerNorm ``scale``/``bias``).
- ``tf``: a TensorFlow checkpoint (``tf.train.Checkpoint(params={name: tf.Variable})``), in
  the spec's layout (kernels (in, out), HWIO).
- ``orbax``: an Orbax PyTree checkpoint of the Flax parameter tree the JAX backends use
  (``{"layers_0": {"kernel", "bias"}, ...}``).
- ``hf``: for a ``toolkit.GPT``, ``model.safetensors`` and ``config.json`` that Hugging Face's
  ``GPT2LMHeadModel.from_pretrained(dir)`` loads offline: the toolkit's GPT is GPT-2's
  architecture, mapped by renaming alone (``toolkit.models.gpt2_files``). ``toolkit.GPT.
  from_pretrained(dir)`` reads such a directory back as a spec to fine-tune.

Parameters are exported, and for native torch models their buffers (BatchNorm statistics) too;
optimizer state stays in the toolkit's own format.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

import toolkit
from adapters._common import quiet_start
from toolkit.checkpoint.resume import directory_contents
from toolkit.models.specs import spec_from_dict

FORMATS = ("torch", "tf", "orbax", "hf")


_USAGE = ("pass the run's checkpoint directory (the Trainer's checkpoint_dir), its latest or "
          "one of its step_* directories: python -m adapters.export CHECKPOINT --format "
          f"{{{','.join(FORMATS)}}} --out PATH")


def load(path: str | os.PathLike) -> toolkit.Checkpoint:
    """The checkpoint ``path`` names: a ``step_*`` directory, a checkpoint directory (its
    newest intact checkpoint) or that directory's ``latest`` file (the same).

    Raises:
        ToolkitError: none of those holds a checkpoint; the message says what ``path`` is.
    """
    path = Path(path)
    try:
        if (path / "manifest.json").is_file():
            return toolkit.read_checkpoint(path)
        # ``latest`` is a small text file naming the newest step_* directory beside it
        store = toolkit.CheckpointStore(path.parent if path.name == "latest" and path.is_file()
                                        else path)
        if store.checkpoints():
            return store.load("latest")
    except toolkit.CheckpointError as err:  # its hint speaks of --resume, which export lacks
        raise toolkit.ToolkitError(err.message, _USAGE) from None
    raise toolkit.ToolkitError(f"no checkpoint in {path}: {_found(path)}", _USAGE)


def _found(path: Path) -> str:
    """What ``path`` is, for an error saying it holds no checkpoint."""
    if path.name == "latest" and path.is_file():
        named = path.read_text(errors="replace").strip() or "nothing"
        return f"it names {named}, and {path.parent} has no step_* directory"
    what = directory_contents(path)
    return f"no manifest.json and no step_* directory; it {what}" if what.startswith(
        "holds ") else f"it {what}"


def weights(ckpt: toolkit.Checkpoint) -> dict[str, np.ndarray]:
    return {k[len("params/"):]: v for k, v in ckpt.tensors.items() if k.startswith("params/")}


def torch_module(spec):
    """The ``torch.nn.Module`` of a spec model (``toolkit.MLP``, ``CNN`` or ``GPT``), as the
    horovod-torch backend builds it: what a ``--format torch`` export loads into.

    Example:
        >>> import torch, toolkit
        >>> net = torch_module(toolkit.MLP((4, 3)))
        >>> sorted(net.state_dict())
        ['layers.0.bias', 'layers.0.weight']
    """
    import torch

    from adapters.horovod_torch.models.spec import build_spec_model

    net, _ = build_spec_model(torch, spec)
    return net


def to_torch(ckpt: toolkit.Checkpoint, out: Path) -> None:
    import torch

    from adapters.horovod_torch.models.spec import build_spec_model

    spec = spec_from_dict(ckpt.meta.get("model"))
    params = weights(ckpt)
    if spec is None:  # a native torch model: its names are already torch's, buffers included
        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in params.items()}
        state.update({k[len("buffers/"):]: torch.from_numpy(np.ascontiguousarray(v))
                      for k, v in ckpt.tensors.items() if k.startswith("buffers/")})
    else:
        net, layout = build_spec_model(torch, spec)
        with torch.no_grad():
            for name, p, to_framework, _ in layout:
                p.copy_(torch.from_numpy(np.ascontiguousarray(to_framework(params[name]))))
        state = net.state_dict()
    torch.save(state, out)


def to_tf(ckpt: toolkit.Checkpoint, out: Path) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with quiet_start():
        import tensorflow as tf

    variables = {k: tf.Variable(v, name=k.replace(".", "_")) for k, v in weights(ckpt).items()}
    tf.train.Checkpoint(params=variables).write(str(out))


def to_orbax(ckpt: toolkit.Checkpoint, out: Path) -> None:
    import orbax.checkpoint as ocp

    from toolkit.models.gpt import GPT

    if isinstance(spec_from_dict(ckpt.meta.get("model")), GPT):
        from adapters._jax.models.gpt import to_tree

        tree = to_tree(weights(ckpt))
    else:
        tree: dict = {}
        for name, value in weights(ckpt).items():
            *module, leaf = name.split(".")
            tree.setdefault("_".join(module), {})[leaf] = value
    ocp.PyTreeCheckpointer().save(out.resolve(), tree)


def to_hf(ckpt: toolkit.Checkpoint, out: Path) -> None:
    from toolkit.models.gpt import GPT
    from toolkit.models.gpt2_files import save_pretrained

    spec = spec_from_dict(ckpt.meta.get("model"))
    if not isinstance(spec, GPT):
        raise toolkit.ToolkitError(
            f"--format hf writes GPT-2 models; {ckpt.path} holds "
            f"{type(spec).__name__ if spec is not None else 'a native model'}",
            "export it with --format torch, tf or orbax")
    save_pretrained(spec, weights(ckpt), out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m adapters.export", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("checkpoint", help="a run's checkpoint directory, its latest, or one "
                   "step_* directory in it")
    p.add_argument("--format", choices=FORMATS, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists() and args.format == "orbax":
        raise toolkit.ToolkitError(f"{out} exists", "choose a new --out (Orbax never overwrites)")
    out.parent.mkdir(parents=True, exist_ok=True)
    ckpt = load(args.checkpoint)
    {"torch": to_torch, "tf": to_tf, "orbax": to_orbax, "hf": to_hf}[args.format](ckpt, out)
    print(f"exported step {ckpt.step} of {ckpt.path} to {out} ({args.format})", file=sys.stderr)


if __name__ == "__main__":
    toolkit.run(main)

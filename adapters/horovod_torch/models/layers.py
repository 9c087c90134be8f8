"""What every torch model builder of the specs shares: the identity layout conversion and
activation checkpointing of one unit (``spec.py`` builds the MLP and CNN, ``gpt.py`` the GPT,
both on these, so neither imports the other for them)."""

from __future__ import annotations


def same(a):
    """The identity conversion of a layout entry (the array is in torch's layout already)."""
    return a


def recomputing(torch, module, enabled: bool):
    """``module``'s call, or under ``enabled`` (activation checkpointing) while gradients are
    taken, the same call through ``torch.utils.checkpoint`` (only its input kept; its forward
    run again in the backward pass, with the same random state)."""
    from torch.utils.checkpoint import checkpoint

    def call(*args):
        if enabled and torch.is_grad_enabled():
            return checkpoint(module, *args, use_reentrant=False)
        return module(*args)

    return call

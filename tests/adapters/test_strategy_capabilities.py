"""A strategy declares what its build takes (``adapters._backend.StrategyBase``: ``skips``,
``recomputes``, ``precisions``, ...). Every built-in strategy runs these options; one of a
user's own (docs/architecture.md) that declares none is refused by the backend before its model
is built, naming the option and the layout."""

import pytest

import adapters
import toolkit
from adapters._backend import StrategyBase


class Bare(StrategyBase):
    def build(self, *args, **kwargs):
        raise AssertionError("built")


@pytest.mark.parametrize("precision, options, message", [
    ("32", {"skip_nonfinite": True},
     "jax-pjit cannot skip a step under data_parallel (on_nonfinite='skip')\nHINT: use "
     "on_nonfinite='stop', or give this strategy a skip_nonfinite build option "
     "(docs/architecture.md)"),
    ("32", {"activation_checkpointing": True},
     "jax-pjit cannot recompute activations under data_parallel "
     "(activation_checkpointing=True)\nHINT: drop activation_checkpointing for this layout "
     "(docs/memory.md says which recompute)"),
    ("bf16-mixed", {},
     "jax-pjit does not run precision 'bf16-mixed' under data_parallel\nHINT: this strategy "
     "runs: 32, 64")])
def test_a_strategy_of_your_own_is_refused_what_it_does_not_declare(precision, options,
                                                                     message):
    backend = adapters.get("jax-pjit", precision=precision)
    backend.setup(toolkit.current_env())
    backend.strategy = Bare(backend.runtime, backend.layout)
    with pytest.raises(toolkit.ToolkitError) as err:
        backend.build(toolkit.MLP((4, 2)), toolkit.SGD(lr=0.1), "cross_entropy", **options)
    assert str(err.value) == message

"""Objects in error messages are named by their class and settings, never their repr."""

import dataclasses

import toolkit
from toolkit.errors import describe


def test_a_torch_optimizer_is_named_by_class_and_scalar_defaults():
    torch = __import__("torch")
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=0.003, weight_decay=1e-4)
    text = describe(opt)
    assert text.startswith("AdamW(lr=0.003, ") and "weight_decay=0.0001" in text, text
    assert "\n" not in text and "Parameter Group" not in repr(text) and text.endswith(", ...)")


def test_specs_values_and_containers():
    assert describe(toolkit.SGD(lr=0.1)) == \
        "SGD(lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0)"
    assert describe("lamb") == "'lamb'" and describe(None) == "None"
    assert describe((1, "a")) == "tuple of 2 (int, str)"

    @dataclasses.dataclass
    class Odd:
        n: int = 3
        items: tuple = (1, 2)

    assert describe(Odd()) == "Odd(n=3)"  # non-scalar settings are left out
    assert describe(object()) == "object"


def test_a_keras_like_object_with_a_failing_config_is_named_by_class():
    class Half:
        def get_config(self):
            raise RuntimeError("not built")

    assert describe(Half()) == "Half"

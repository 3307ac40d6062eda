"""What ``Module.to()`` leaves behind: found by find_unmoved, counted by the checks, named
by guard."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit import _checks

from .helpers import CPU, META, require_package


@dataclasses.dataclass
class Anchors:
    boxes: torch.Tensor
    names: tuple[str, ...] = ("a",)


class Stranded(nn.Module):
    """Every kind of tensor Module.to() does not move, beside a registered layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = torch.ones(3)  # plain attribute
        self.prior = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
        self.table = [torch.ones(3)]
        self.lookup = {"w": torch.ones(2)}
        self.anchors = Anchors(torch.ones(4, 4))
        self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.blocks[1].scale = torch.ones(1)
        self.heads = [nn.Linear(1, 1)]  # a plain list, not a ModuleList
        self.flow = torch.distributions.TransformedDistribution(
            torch.distributions.Normal(torch.zeros(1), torch.ones(1)),
            [torch.distributions.AffineTransform(torch.zeros(1), torch.ones(1))],
        )
        self.register_buffer("running", torch.zeros(2))
        self.views = [self.running]  # a second name for a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


EXPECTED = [
    "scale",
    "prior.loc",
    "prior.scale",
    "table[0]",
    "lookup['w']",
    "anchors.boxes",
    "heads[0].weight",
    "heads[0].bias",
    "flow.base_dist.loc",
    "flow.base_dist.scale",
    "flow.transforms[0].loc",
    "flow.transforms[0].scale",
    "views[0]",
    "blocks.1.scale",
]


def test_every_tensor_to_leaves_behind_is_found_by_the_path_a_user_writes() -> None:
    model = dk.to_device(Stranded(), META)
    found = dk.find_unmoved(model)
    assert sorted(found) == sorted(EXPECTED)
    assert set(found.values()) == {CPU}
    assert model.lin.weight.is_meta  # what .to() moves is never listed


def test_before_a_move_the_same_tensors_are_found_and_registered_ones_never() -> None:
    model = Stranded()
    found = dk.find_unmoved(model)
    assert sorted(found) == sorted(EXPECTED)  # the buffer's second name included
    model.tied = [model.lin.weight]  # a registered parameter: moved in place on a GPU
    assert "tied[0]" not in dk.find_unmoved(model)


def test_a_cycle_is_walked_once() -> None:
    model = nn.Linear(2, 2)
    loop: list[object] = [torch.ones(1)]
    loop.append(loop)
    model.loop = loop
    model.me = [model]  # the module itself: registered, moved in place
    assert dk.find_unmoved(model) == {"loop[0]": CPU}


@pytest.mark.parametrize(
    "module",
    [
        nn.LSTM(2, 3),
        nn.GRU(2, 3),
        nn.TransformerEncoderLayer(8, 2, dim_feedforward=8),
        nn.MultiheadAttention(4, 2),
        nn.BatchNorm2d(3),
        nn.Embedding(5, 2),
        nn.Conv2d(1, 1, 3),
        nn.utils.parametrizations.weight_norm(nn.Linear(2, 2)),
    ],
    ids=lambda module: type(module).__name__,
)
def test_torch_s_own_layers_leave_nothing_behind(module: nn.Module) -> None:
    assert dk.find_unmoved(module) == {}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the older utilities are deprecated
def test_attributes_a_forward_hook_recomputes_are_not_stray() -> None:
    # spectral_norm and the older weight_norm keep `weight` as a plain attribute, which
    # their hook computes from parameters before every forward.
    assert dk.find_unmoved(nn.utils.spectral_norm(nn.Linear(2, 2))) == {}
    assert dk.find_unmoved(nn.utils.weight_norm(nn.Linear(2, 2))) == {}


def test_a_model_of_a_thousand_modules_is_walked_quickly() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(500)])
    assert sum(1 for _ in model.modules()) > 1000
    assert dk.find_unmoved(model) == {}


def test_the_checks_count_what_to_leaves_behind() -> None:
    model = dk.to_device(Stranded(), META)
    seen = dk.find_devices(model)
    assert sorted(seen[CPU]) == sorted(EXPECTED)  # the same paths, each walk in its order
    with pytest.raises(dk.DeviceMismatchError, match=re.escape("cpu has Stranded.scale")):
        dk.check_same_device(model)
    assert dk.find_devices({"model": model})[CPU][0] == "['model'].scale"


def test_to_device_leaves_them_as_module_to_does() -> None:
    model = Stranded()
    scale = model.scale
    assert dk.to_device(model, META).scale is scale


def test_guard_names_a_plain_attribute_and_its_fix_before_pytorch_fails() -> None:
    model = dk.to_device(Stranded(), META)
    msg = (
        "Stranded.scale is on cpu but the parameters of Stranded (e.g. lin.weight, "
        "lin.bias) are on meta"
    )
    with dk.guard(model), pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info:
        model(torch.ones(1, 3, device=META))
    assert str(info.value).endswith(
        "Module.to() does not move a plain attribute: make it a buffer with "
        "register_buffer(name, tensor, persistent=False)."
    )


def test_guard_names_a_distribution_with_its_own_fix() -> None:
    class WithPrior(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.prior = torch.distributions.Normal(torch.zeros(3), torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.prior.loc

    model = dk.to_device(WithPrior(), META)
    with dk.guard(model), pytest.raises(dk.DeviceMismatchError) as info:
        model(torch.ones(1, 3, device=META))
    assert str(info.value).startswith("WithPrior.prior.loc is on cpu")
    assert "build the distribution in forward()" in str(info.value)


def test_guard_reads_the_place_again_so_a_fixed_attribute_passes() -> None:
    model = dk.to_device(Stranded(), META)
    for name in ("prior", "table", "lookup", "anchors", "heads", "flow", "views"):
        delattr(model, name)
    model.blocks[1].scale = model.blocks[1].scale.to(META)
    with dk.guard(model):
        with pytest.raises(dk.DeviceMismatchError):
            model(torch.ones(1, 3, device=META))
        model.scale = model.scale.to(META)  # rebound, not added: read again at its place
        assert model(torch.ones(1, 3, device=META)).is_meta


def test_guard_walks_the_module_once_not_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    walks: list[object] = []
    real = _checks.strays
    monkeypatch.setattr(_checks, "strays", lambda *a, **k: walks.append(a) or real(*a, **k))
    with dk.guard(model):
        for _ in range(5):
            model(torch.ones(1, 4))
        assert len(walks) == 1  # at install; a call compares, never walks
        model.extra = torch.ones(1)  # a new attribute: found at the next call
        with pytest.raises(dk.DeviceMismatchError, match=re.escape("Sequential.extra is on")):
            model.to(META)(torch.ones(1, 4, device=META))
    assert len(walks) == 2


def test_find_unmoved_refuses_what_is_no_module() -> None:
    with pytest.raises(TypeError, match=re.escape("Expected a torch.nn.Module to look through")):
        dk.find_unmoved({"x": torch.ones(1)})  # type: ignore[arg-type]


def test_a_transformers_model_leaves_nothing_behind() -> None:
    transformers = require_package("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=50, n_positions=8)
    assert dk.find_unmoved(transformers.GPT2LMHeadModel(config)) == {}

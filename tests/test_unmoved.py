"""What ``Module.to()`` leaves behind: found by find_unmoved, counted by the checks, named
by guard."""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, prune

import devicekit as dk
from devicekit._base import _compat, listing
from devicekit._checks import _guard
from devicekit._core import _tree

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


# What PyTorch's reparametrisations recompute before each forward. Pruning, and the older
# weight_norm and spectral_norm, keep `weight` as a plain attribute that their forward
# pre-hook sets from moved tensors (weight_orig and weight_mask, ...); parametrize makes
# it a property.


def _l1(layers: list[nn.Linear]) -> None:
    prune.l1_unstructured(layers[0], "weight", amount=0.5)


def _random(layers: list[nn.Linear]) -> None:
    prune.random_unstructured(layers[0], "weight", amount=0.5)


def _global(layers: list[nn.Linear]) -> None:
    targets = [(layers[0], "weight"), (layers[1], "weight"), (layers[1], "bias")]
    prune.global_unstructured(targets, pruning_method=prune.L1Unstructured, amount=0.5)


def _stacked(layers: list[nn.Linear]) -> None:
    prune.l1_unstructured(layers[0], "weight", amount=0.3)
    prune.random_unstructured(layers[0], "weight", amount=0.3)
    prune.ln_structured(layers[0], "weight", amount=0.3, n=2, dim=0)
    (hook,) = layers[0]._forward_pre_hooks.values()
    assert isinstance(hook, prune.PruningContainer)  # three methods, one hook


def _weight_norm(layers: list[nn.Linear]) -> None:
    nn.utils.weight_norm(layers[0])


def _spectral_norm(layers: list[nn.Linear]) -> None:
    nn.utils.spectral_norm(layers[0])


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _parametrized(layers: list[nn.Linear]) -> None:
    parametrize.register_parametrization(layers[0], "weight", _Symmetric())
    nn.utils.parametrizations.weight_norm(layers[1])


REPARAMETRISED: dict[str, Callable[[list[nn.Linear]], None]] = {
    "l1_unstructured": _l1,
    "random_unstructured": _random,
    "global_unstructured": _global,
    "several prunings stacked": _stacked,
    "weight_norm": _weight_norm,
    "spectral_norm": _spectral_norm,
    "parametrize": _parametrized,
}


def _reparametrised(how: str) -> nn.Sequential:
    layers = [nn.Linear(3, 3), nn.Linear(3, 3)]
    REPARAMETRISED[how](layers)
    return nn.Sequential(layers[0], nn.ReLU(), layers[1])


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the older utilities are deprecated
@pytest.mark.parametrize("how", REPARAMETRISED)
def test_what_a_reparametrisation_recomputes_from_moved_tensors_is_no_leftover(how: str) -> None:
    model = dk.to_device(_reparametrised(how), META)
    assert dk.find_unmoved(model) == {}
    assert list(dk.find_devices(model)) == [META]
    assert dk.check_same_device(model) == META
    x = torch.ones(1, 3, device=META)
    assert model(x).is_meta  # it runs unguarded: its hooks recompute from moved tensors
    with dk.guard(model), dk.guard(model, recurse=True):
        assert model(x).is_meta


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the older utilities are deprecated
@pytest.mark.parametrize("how", REPARAMETRISED)
def test_a_real_leftover_beside_a_reparametrised_weight_is_still_found(how: str) -> None:
    model = _reparametrised(how)
    model[0].scale = torch.ones(3)  # a plain attribute of the reparametrised layer
    model.weights = [model[0].weight]  # a second name: a stale copy once moved
    moved = dk.to_device(model, META)
    assert dk.find_unmoved(moved) == {"weights[0]": CPU, "0.scale": CPU}
    layer = f"Sequential.0 ({type(moved[0]).__name__})"  # parametrize makes a subclass
    msg = f"{layer}.scale is on cpu but the parameters of {layer} (e.g. "
    with (
        dk.guard(moved, recurse=True),
        pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info,
    ):
        moved(torch.ones(1, 3, device=META))
    assert "(and" not in str(info.value)  # the weight its hook recomputes is not named


def test_a_parametrization_s_own_plain_tensor_is_a_leftover() -> None:
    class Offset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.offset = torch.ones(3, 3)  # not a buffer: Module.to() leaves it

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.offset

    layer = nn.Linear(3, 3)
    parametrize.register_parametrization(layer, "weight", Offset())
    moved = dk.to_device(nn.Sequential(layer), META)
    assert dk.find_unmoved(moved) == {"0.parametrizations.weight.0.offset": CPU}


def test_only_pytorch_s_own_reparametrising_hooks_excuse_an_attribute() -> None:
    # A hook of the user's that happens to carry a `name` recomputes nothing.
    class Logging:
        name = "scale"

        def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
            return None

    layer = nn.Linear(2, 2)
    layer.scale = torch.ones(2)
    layer.register_forward_pre_hook(Logging())
    assert dk.find_unmoved(dk.to_device(layer, META)) == {"scale": CPU}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the older utilities are deprecated
def test_recomputed_attributes_names_each_reparametrising_hook_s_attribute() -> None:
    pruned = prune.l1_unstructured(nn.Linear(2, 2), "bias", amount=0.5)
    prune.random_unstructured(pruned, "weight", amount=0.5)
    prune.random_unstructured(pruned, "weight", amount=0.5)  # a PruningContainer now
    assert _compat.recomputed_attributes(pruned) == {"weight", "bias"}
    assert _compat.recomputed_attributes(nn.utils.weight_norm(nn.Linear(2, 2))) == {"weight"}
    spectral = nn.utils.spectral_norm(nn.Linear(2, 2), name="bias")
    assert _compat.recomputed_attributes(spectral) == {"bias"}
    plain = nn.Linear(2, 2)
    plain.register_forward_pre_hook(lambda module, args: None)
    assert _compat.recomputed_attributes(plain) == frozenset()


def test_recomputed_attributes_imports_nothing_to_look(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch.nn.utils.prune")  # as if never imported
    plain = nn.Linear(2, 2)
    plain.register_forward_pre_hook(lambda module, args: None)
    assert _compat.recomputed_attributes(plain) == frozenset()
    assert "torch.nn.utils.prune" not in sys.modules


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
    real = _guard.strays
    monkeypatch.setattr(_guard, "strays", lambda *a, **k: walks.append(a) or real(*a, **k))
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


# Depth: the walk keeps its own stack, with to_device's depth rule.


FRAMES_LEFT = 150
# Twice as deep as the stack has frames left: a walk that recursed once a level fails as
# surely as at 3,000 lists, where the paths alone (13.5 million characters, as each path
# repeats its parents') took the checks 20-30 s.
DEEPER_THAN_THE_STACK = 2 * FRAMES_LEFT


@pytest.fixture
def shallow_stack() -> Iterator[None]:
    """FRAMES_LEFT frames left to the test: a walk that recursed once a level would fail."""
    # PyTorch's first forward on meta imports its decompositions, deeper than that.
    nn.Linear(2, 2, device=META)(torch.ones(1, 2, device=META))
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + FRAMES_LEFT)  # about 200 under plain pytest
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def _chain(depth: int) -> list[Any]:
    """``[t, [t, [... [t] ...]]]``: ``depth`` lists, a tensor in each."""
    data: list[Any] = [torch.ones(1)]
    for _ in range(depth - 1):
        data = [torch.ones(1), data]
    return data


class Deep(nn.Module):
    def __init__(self, deep: Any) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("offset", torch.zeros(2))  # its own: guarded with recurse=True
        self.deep = deep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.offset


@pytest.mark.usefixtures("shallow_stack")
@pytest.mark.parametrize("depth", [3, DEEPER_THAN_THE_STACK])
def test_a_list_deeper_than_the_stack_is_walked_as_a_shallow_one(depth: int) -> None:
    model = dk.to_device(Deep(_chain(depth)), META)
    expected = [f"deep{'[1]' * level}[0]" for level in range(depth)]
    assert dk.find_unmoved(model) == dict.fromkeys(expected, CPU)
    assert list(dk.find_unmoved(model)) == expected  # in the order the lists hold them
    assert dk.find_devices(model) == {META: ["lin.weight", "lin.bias", "offset"], CPU: expected}
    shown = listing([f"Deep.{path}" for path in expected])
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(f"cpu has {shown}")) as info:
        dk.check_same_device(model)
    assert info.value.devices[CPU] == [f"Deep.{path}" for path in expected]
    x = torch.ones(1, 2, device=META)
    with dk.guard(model):
        with pytest.raises(dk.DeviceMismatchError) as info:
            model(x)
        assert str(info.value).startswith(
            "Deep.deep[0] is on cpu but the parameters of Deep (e.g. lin.weight, lin.bias) "
            "are on meta. Off meta too: Deep.deep[1][0]"
            + (" and Deep.deep[1][1][0]." if depth == 3 else ", Deep.deep[1][1][0], ")
        )
        model.deep = dk.to_device(model.deep, META)  # fixed in place: read again, not walked
        assert model(x).is_meta


@pytest.mark.usefixtures("shallow_stack")
def test_a_cycle_deeper_than_the_stack_is_walked_once() -> None:
    deep = _chain(DEEPER_THAN_THE_STACK)
    innermost = deep
    while len(innermost) == 2:
        innermost = innermost[1]
    innermost.append(deep)  # the innermost list holds the outermost
    found = dk.find_unmoved(Deep(deep))
    assert list(found) == [f"deep{'[1]' * level}[0]" for level in range(DEEPER_THAN_THE_STACK)]


def _nested(depth: int) -> Any:
    data: Any = torch.ones(1)
    for _ in range(depth):
        data = [data]
    return data


def _refusal(root: str) -> str:
    """to_device's refusal of a list 10,001 deep, its path starting at ``root``."""
    return (
        "Expected data nested at most 10,000 containers deep, but "
        f"{root}[0][0][0][0][0][0][0][0]...<9,984 more levels>...[0][0][0][0][0][0][0][0] "
        "goes deeper."
    )


@pytest.mark.usefixtures("shallow_stack")
def test_the_checks_take_the_depth_to_device_takes() -> None:
    model = Deep(_nested(_tree.MAX_DEPTH))
    assert dk.find_unmoved(model) == {f"deep{'[0]' * _tree.MAX_DEPTH}": CPU}
    with dk.guard(model):
        model(torch.ones(1, 2))


@pytest.mark.usefixtures("shallow_stack")
@pytest.mark.parametrize(
    ("check", "root"),
    [
        (dk.find_unmoved, "Deep.deep"),
        (dk.find_devices, "data.deep"),
        (lambda model: dk.find_devices({"model": model}), "data['model'].deep"),
        (dk.check_same_device, "Deep.deep"),
        (lambda model: dk.check_same_device(torch.ones(1), [model]), "data[1][0].deep"),
        (dk.guard, "Deep.deep"),
        (lambda model: dk.guard(nn.Sequential(model)), "Sequential.0.deep"),
        (lambda model: dk.guard(model, recurse=True), "Deep.deep"),
    ],
    ids=[
        "find_unmoved",
        "find_devices",
        "find_devices in a dict",
        "check_same_device",
        "check_same_device, second argument",
        "guard",
        "guard, a submodule's",
        "guard, recurse",
    ],
)
def test_deeper_than_to_device_takes_is_refused_with_its_path(
    check: Callable[[nn.Module], object], root: str
) -> None:
    deep = _nested(_tree.MAX_DEPTH + 1)
    with pytest.raises(dk.TransferError, match=re.escape(_refusal("data"))):
        dk.to_device(deep, META)  # the rule the checks share
    with pytest.raises(dk.TransferError, match=re.escape(_refusal(root))):
        check(Deep(deep))


@pytest.mark.usefixtures("shallow_stack")
def test_a_guarded_forward_refuses_an_attribute_made_too_deep_since() -> None:
    model = Deep([])
    x = torch.ones(1, 2)
    with dk.guard(model):
        model(x)
        model.later = _nested(_tree.MAX_DEPTH + 1)  # a new attribute: walked at the next call
        with pytest.raises(dk.TransferError, match=re.escape(_refusal("Deep.later"))):
            model(x)

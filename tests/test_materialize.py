"""dk.materialize: meta models given storage and initialised, and what nothing wrote named.

Plain models on the CPU here; FSDP2-sharded ones in two gloo processes (the torchtitan
flow: build on meta, fully_shard each layer and the root, materialize, train a step).
"""

from __future__ import annotations

import json
import math
import re
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

import devicekit as dk

from .programs import TwoRanks, run_program

if TYPE_CHECKING:
    from pathlib import Path


class Rotary(nn.Module):
    """A rotary embedding's frequencies: a non-persistent buffer computed in ``__init__``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", self.frequencies(dim), persistent=False)

    @staticmethod
    def frequencies(dim: int) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))


class TinyLM(nn.Module):
    """Tied embeddings, a rotary buffer, a norm with running statistics, a bare parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.rotary = Rotary(8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.embed(tokens) * self.scale)
        return self.head(hidden * self.rotary.inv_freq.repeat(2))


def init_what_no_reset_writes(module: nn.Module) -> None:
    if isinstance(module, Rotary):
        module.inv_freq.copy_(Rotary.frequencies(8))
    if isinstance(module, TinyLM):
        nn.init.ones_(module.scale)


def on_meta() -> TinyLM:
    with torch.device("meta"):
        return TinyLM()


def test_a_meta_model_gets_storage_its_modules_initialise_and_init_completes() -> None:
    model = on_meta()
    assert dk.materialize(model, "cpu", init=init_what_no_reset_writes) is model
    assert all(t.device == torch.device("cpu") for t in model.state_dict().values())
    assert model.head.weight is model.embed.weight  # tied: still one parameter
    assert len(list(model.parameters())) == 4
    assert torch.equal(model.rotary.inv_freq, Rotary.frequencies(8))
    assert int(model.norm.num_batches_tracked) == 0  # BatchNorm's own reset
    assert torch.equal(model.norm.running_var, torch.ones(8))
    assert torch.equal(model.scale.detach(), torch.ones(8))
    assert model.scale.requires_grad
    assert torch.isfinite(model(torch.tensor([1, 2, 3]))).all()


def test_what_no_initialiser_writes_is_named_and_the_model_is_left_as_it_was() -> None:
    model = on_meta()
    before = dict(model.state_dict(keep_vars=True))
    with pytest.raises(dk.DeviceKitError) as caught:
        dk.materialize(model, "cpu")
    assert type(caught.value) is dk.DeviceKitError
    message = str(caught.value)
    assert message.startswith(
        "Expected every tensor given storage on cpu to be written by an initialiser, but 2 of "
        "8 hold what the empty storage held"
    )
    assert "\n  scale\n  rotary.inv_freq\n" in message
    assert "Pass init=" in message
    # As it was: every tensor on meta again, the same objects, the tie kept; so a retry works.
    assert model.state_dict(keep_vars=True) == before
    assert all(t.is_meta for t in model.state_dict().values())
    assert model.head.weight is model.embed.weight
    dk.materialize(model, "cpu", init=init_what_no_reset_writes)
    assert torch.equal(model.rotary.inv_freq, Rotary.frequencies(8))


def test_part_written_tensors_say_how_much_and_integers_have_a_sentinel_of_their_own() -> None:
    class Counts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(4, dtype=torch.int64))
            self.weight = nn.Parameter(torch.zeros(10))

        def reset_parameters(self) -> None:
            self.weight.data[:7] = 0.0  # forgets the last three

    with torch.device("meta"):
        model = Counts()
    with pytest.raises(dk.DeviceKitError) as caught:
        dk.materialize(model, "cpu")
    assert "\n  weight: 3 of 10 elements\n  seen\n" in str(caught.value)


def test_tensors_already_on_a_real_device_are_kept_as_they_are() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with torch.device("meta"):
        model[1] = nn.Linear(2, 2)
    kept = model[0].weight.detach().clone()
    first = model[0].weight
    dk.materialize(model, "cpu")
    assert model[0].weight is first
    assert torch.equal(model[0].weight.detach(), kept)
    assert model[1].weight.device == torch.device("cpu")
    assert dk.materialize(model, "cpu") is model  # nothing on meta: nothing to do


def test_init_runs_after_every_reset_on_each_submodule_children_first() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    calls: list[str] = []

    def init(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.5)

    dk.materialize(model, "cpu", init=init)
    assert calls == ["Linear", "Sequential", "Linear", "Sequential"]  # as Module.apply
    assert torch.equal(model[1][0].weight.detach(), torch.full((2, 2), 0.5))  # init wins


def test_an_initialiser_that_fails_leaves_the_model_on_meta_with_its_error() -> None:
    model = on_meta()

    def broken(module: nn.Module) -> None:
        if isinstance(module, Rotary):
            raise KeyError("the user's own mistake")

    with pytest.raises(KeyError, match="the user's own mistake"):
        dk.materialize(model, "cpu", init=broken)
    assert all(t.is_meta for t in model.state_dict().values())
    assert model.head.weight is model.embed.weight
    dk.materialize(model, "cpu", init=init_what_no_reset_writes)


def test_wrong_arguments_are_refused_before_anything_changes() -> None:
    model = on_meta()
    with pytest.raises(TypeError, match=r"^Expected a torch.nn.Module to materialize, got dict"):
        dk.materialize({"w": torch.ones(1)}, "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^Expected init to be a function of a submodule, got"):
        dk.materialize(model, "cpu", init="normal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^Expected a device with storage to materialize on"):
        dk.materialize(model, "meta")
    with pytest.raises(dk.DeviceUnavailableError):
        dk.materialize(model, "cuda:7")
    assert all(t.is_meta for t in model.state_dict().values())


# Real tensors are kept exactly, whatever an initialiser does to their module.


def test_a_loaded_weight_is_kept_when_its_linear_s_reset_initialises_the_meta_bias() -> None:
    layer = nn.Linear(4, 3, device="meta")
    loaded = torch.randn(3, 4)
    layer.load_state_dict({"weight": loaded.clone()}, strict=False, assign=True)
    held = layer.weight
    dk.materialize(layer, "cpu")  # Linear's reset rewrites weight and bias together
    assert layer.weight is held
    assert torch.equal(layer.weight.detach(), loaded)
    assert layer.bias.device == torch.device("cpu")
    assert torch.isfinite(layer.bias).all()
    assert layer.bias.abs().max() <= 1 / math.sqrt(4)  # its reset's bound, from the weight's shape


def test_a_parameters_only_checkpoint_keeps_batchnorm_s_weight_and_bias() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    source = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with torch.no_grad():
        source[1].weight.copy_(torch.tensor([2.0, 3.0, 4.0]))
        source[1].bias.copy_(torch.tensor([0.5, -0.5, 0.25]))
    checkpoint = {name: p.detach().clone() for name, p in source.named_parameters()}
    # assign=True: the model holds the checkpoint's own tensors; its running statistics: meta
    model.load_state_dict(
        {name: t.clone() for name, t in checkpoint.items()}, assign=True, strict=False
    )
    held = dict(model.named_parameters())
    dk.materialize(model, "cpu")
    for name, parameter in model.named_parameters():
        assert parameter is held[name]
        assert torch.equal(parameter.detach(), checkpoint[name])  # bit for bit
    assert torch.equal(model[1].running_var, torch.ones(3))  # BatchNorm's reset wrote these
    assert torch.equal(model[1].running_mean, torch.zeros(3))
    assert int(model[1].num_batches_tracked) == 0


def test_multihead_attention_s_reset_keeps_its_child_s_loaded_bias() -> None:
    with torch.device("meta"):
        attention = nn.MultiheadAttention(4, 2)
    loaded = torch.randn(4)
    attention.out_proj.load_state_dict({"bias": loaded.clone()}, strict=False, assign=True)
    held = attention.out_proj.bias
    dk.materialize(attention, "cpu")  # its reset zeroes out_proj.bias, a child's
    assert attention.out_proj.bias is held
    assert torch.equal(attention.out_proj.bias.detach(), loaded)
    assert torch.equal(attention.in_proj_bias.detach(), torch.zeros(12))
    query = torch.ones(2, 1, 4)
    assert torch.isfinite(attention(query, query, query)[0]).all()


def test_init_writes_only_what_was_given_storage_and_a_tie_it_makes_holds_the_loaded() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(5, 2), nn.Linear(2, 5, bias=False))
    loaded = torch.randn(5, 2)
    model[0].load_state_dict({"weight": loaded.clone()}, assign=True)
    held = model[0].weight

    def init(module: nn.Module) -> None:  # as transformers' _init_weights: every weight
        if isinstance(module, nn.Embedding | nn.Linear):
            nn.init.constant_(module.weight, 0.5)
        if isinstance(module, nn.Sequential):
            assert module[0].weight.is_meta  # out of reach while the initialisers run

    dk.materialize(model, "cpu", init=init)
    assert model[0].weight is held
    assert torch.equal(model[0].weight.detach(), loaded)
    assert torch.equal(model[1].weight.detach(), torch.full((5, 2), 0.5))

    with torch.device("meta"):
        tied = nn.Sequential(nn.Embedding(5, 2), nn.Linear(2, 5, bias=False))
    tied[0].load_state_dict({"weight": loaded.clone()}, assign=True)

    def tie(module: nn.Module) -> None:
        if isinstance(module, nn.Sequential):
            module[1].weight = module[0].weight

    dk.materialize(tied, "cpu", init=tie)
    assert tied[1].weight is tied[0].weight
    assert torch.equal(tied[1].weight.detach(), loaded)


def test_an_initialiser_reading_another_module_s_real_tensor_is_told_why_it_is_meta() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with torch.device("meta"):
        model[1] = nn.Linear(2, 2)
    loaded = model[0].weight.detach().clone()

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Sequential):
            module[1].weight.copy_(module[0].weight)  # a stand-in: meta, no data

    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor") as caught:
        dk.materialize(model, "cpu", init=init)
    assert sys.version_info < (3, 11) or caught.value.__notes__ == [
        (
            "(devicekit.materialize: while an initialiser runs, every tensor that was real "
            "before the call is a meta stand-in, so that none is overwritten, except those of "
            "the module it runs for.)"
        )
    ]
    assert torch.equal(model[0].weight.detach(), loaded)
    assert model[1].weight.is_meta


# What an initialiser wrote is written, whatever it wrote.


class Markers(nn.Module):
    """A lookup table of every uint8, and two "no value yet" markers, set by its own reset."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.empty(256, dtype=torch.uint8))
        self.register_buffer("unset", torch.empty(3))
        self.register_buffer("last", torch.empty(2, dtype=torch.int64))

    def reset_parameters(self) -> None:
        self.table.copy_(torch.arange(256))  # holds 255, uint8's largest value
        self.unset.fill_(math.nan)
        self.last.fill_(torch.iinfo(torch.int64).max)


def test_what_its_reset_writes_is_not_refused_even_a_sentinel_s_value() -> None:
    with torch.device("meta"):
        model = nn.Sequential(Markers(), nn.Linear(2, 2))
    dk.materialize(model, "cpu")
    assert torch.equal(model[0].table, torch.arange(256, dtype=torch.uint8))
    assert torch.isnan(model[0].unset).all()
    assert torch.equal(model[0].last, torch.full((2,), torch.iinfo(torch.int64).max))


def test_what_init_writes_or_puts_in_place_is_written_and_what_it_does_not_is_named() -> None:
    with torch.device("meta"):
        model = nn.Sequential(Rotary(8), nn.Linear(2, 2))
    model[0].register_buffer("marker", torch.empty(2, device="meta"))

    def init(module: nn.Module) -> None:
        if isinstance(module, Rotary):
            module.inv_freq = torch.full((4,), math.nan)  # replaced, not written in place

    with pytest.raises(dk.DeviceKitError) as caught:
        dk.materialize(model, "cpu", init=init)
    assert "but 1 of 4 hold what the empty storage held" in str(caught.value)
    assert "\n  0.marker\n" in str(caught.value)


# A write counted in place is evidence of a write, not of every element written.


class Careless(nn.Module):
    """A reset that writes part of its weight, rescales two tensors and sets one step count."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 2))
        self.gain = nn.Parameter(torch.empty(3))
        self.register_buffer("limit", torch.empty(2))
        self.register_buffer("steps", torch.empty(4, dtype=torch.int64))

    def reset_parameters(self) -> None:
        self.weight[:4] = 0.5  # the other four rows forgotten
        self.gain.mul_(0.5)  # as if it held a value already
        self.limit.clamp_(0.0, 1.0)
        self.steps[0] = 0  # the first of four


def test_what_a_counted_write_leaves_of_the_filler_is_named_element_by_element() -> None:
    with torch.device("meta"):
        model = nn.Sequential(Careless(), nn.Linear(2, 2))
    expected = (
        "Expected every tensor given storage on cpu to be written by an initialiser, but 4 of "
        "6 hold what the empty storage held (checked by filling it first with a NaN whose bits "
        "float('nan') never has, or with 0x5A in every byte of an integer):\n"
        "  0.weight: 8 of 16 elements, after an in-place write\n"
        "  0.gain, after an in-place write\n"
        "  0.limit, after an in-place write\n"
        "  0.steps: 3 of 4 elements, after an in-place write\n"
        "An in-place write leaves the elements it does not cover (w[:4] = ...) as they were, and "
        "one that computes from what they held (mul_, clamp_) keeps the filler in them. Pass "
        "init=, a function of each submodule that sets them (a buffer computed in __init__ is "
        "computed again there), or give their modules a reset_parameters() that writes them "
        "whole. A NaN meant to stay is told from the filler by its bits: write float('nan') "
        "itself (fill_(float('nan'))), not a NaN computed from another. The module's meta "
        "tensors are back in place: call materialize again with init=."
    )
    with pytest.raises(dk.DeviceKitError, match=f"^{re.escape(expected)}$"):
        dk.materialize(model, "cpu")
    assert all(t.is_meta for t in model.state_dict().values())

    def complete(module: nn.Module) -> None:
        if isinstance(module, Careless):
            module.weight[4:] = 0.25
            module.gain.fill_(1.0)
            module.limit.fill_(1.0)
            module.steps[1:] = 0

    dk.materialize(model, "cpu", init=complete)
    assert torch.equal(model[0].steps, torch.zeros(4, dtype=torch.int64))
    assert torch.isfinite(model[0].weight).all()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int32,
        torch.uint32,
        torch.int64,
    ],
)
def test_the_elements_a_write_leaves_are_named_in_every_dtype_with_a_filler_of_its_own(
    dtype: torch.dtype,
) -> None:
    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("values", torch.empty(4, dtype=dtype))

        def reset_parameters(self) -> None:
            self.values[:2] = torch.zeros(2, dtype=dtype)

    with torch.device("meta"):
        model = Half()
    line = "\n  values: 2 of 4 elements, after an in-place write\n"
    with pytest.raises(dk.DeviceKitError, match=re.escape(line)):
        dk.materialize(model, "cpu")


@pytest.mark.parametrize("dtype", [torch.bool, torch.float4_e2m1fn_x2, torch.uint4, torch.bits8])
def test_a_dtype_without_a_filler_is_given_storage_and_left_unchecked(dtype: torch.dtype) -> None:
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    model.register_buffer("packed", torch.empty(3, dtype=dtype, device="meta"))
    dk.materialize(model, "cpu")  # nothing can tell what a write left in these
    assert model.packed.device == torch.device("cpu")
    assert model.packed.dtype == dtype


class Marked(nn.Module):
    """Markers written whole and then set in part: NaN and the largest value, on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.empty(4))
        self.register_buffer("nearest", torch.empty(4, dtype=torch.int64))
        self.register_buffer("ids", torch.empty(4, dtype=torch.int32))

    def reset_parameters(self) -> None:
        self.seen.fill_(float("nan"))
        self.seen[0] = 1.0
        self.nearest.fill_(torch.iinfo(torch.int64).max)  # "none yet": every distance larger
        self.nearest[0] = 0
        self.ids.copy_(torch.tensor([torch.iinfo(torch.int32).max, -1, 0, 7]))


def test_values_written_on_purpose_are_not_refused_even_in_part() -> None:
    with torch.device("meta"):
        model = Marked()
    dk.materialize(model, "cpu")
    assert torch.isnan(model.seen[1:]).all()
    assert int(model.nearest[1]) == torch.iinfo(torch.int64).max
    assert model.ids.tolist() == [torch.iinfo(torch.int32).max, -1, 0, 7]


# What is left on meta after the initialisers, and what cannot be given storage.


class CachedRotary(Rotary):
    """Rotary frequencies and, as many models keep it, a plain attribute caching the cosines."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.cos_cached = torch.outer(torch.arange(4.0), self.inv_freq).cos()


def rotary_init(module: nn.Module) -> None:
    if isinstance(module, CachedRotary):
        module.inv_freq.copy_(Rotary.frequencies(8))
        module.cos_cached = torch.outer(torch.arange(4.0), module.inv_freq).cos()


def test_a_plain_meta_attribute_is_named_with_its_fix_and_init_can_set_it() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), CachedRotary(8))

    def frequencies_only(module: nn.Module) -> None:
        if isinstance(module, Rotary):
            module.inv_freq.copy_(Rotary.frequencies(8))

    expected = (
        "Expected every tensor of the module on cpu once the initialisers ran, but 1 is "
        "still on the meta device:\n  1.cos_cached: a plain attribute, not a parameter or "
        "buffer\nmaterialize gives storage to parameters and buffers only: register a plain "
        "tensor attribute as a buffer (register_buffer(name, tensor, persistent=False)), or "
        "set it on the device in init=. The module's meta tensors are back in place: call "
        "materialize again with init=."
    )
    with pytest.raises(dk.DeviceKitError, match=f"^{re.escape(expected)}$"):
        dk.materialize(model, "cpu", init=frequencies_only)
    assert all(t.is_meta for t in model.state_dict().values())
    dk.materialize(model, "cpu", init=rotary_init)
    assert model[1].cos_cached.device == torch.device("cpu")
    # Loaded with assign=True, only the plain attribute is on meta: init still runs for it.
    with torch.device("meta"):
        loaded = CachedRotary(8)
    loaded.load_state_dict({}, assign=True)
    loaded.inv_freq = Rotary.frequencies(8)
    with pytest.raises(dk.DeviceKitError, match=re.escape("  cos_cached: a plain attribute")):
        dk.materialize(loaded, "cpu")
    dk.materialize(loaded, "cpu", init=rotary_init)
    assert torch.isfinite(loaded.cos_cached).all()


def test_a_parameter_init_adds_on_meta_is_named_not_returned_on_meta() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))

    def adds_a_gain(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):  # from the weight's device: meta if it was loaded
            module.gain = nn.Parameter(torch.ones(2, device="meta"))

    expected = (
        "but 1 is still on the meta device:\n  0.gain: put there on meta by an initialiser\n"
        "Make what an initialiser adds on the device itself, not on another tensor's device: "
        "while it runs, another module's tensors that were real before the call are on meta."
    )
    with pytest.raises(dk.DeviceKitError, match=re.escape(expected)):
        dk.materialize(model, "cpu", init=adds_a_gain)
    assert model[0].weight.is_meta  # put back, as for what nothing wrote


def test_a_lazy_module_built_on_meta_is_refused_with_what_to_do() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.LazyLinear(3), nn.ReLU())
    expected = (
        "Expected meta tensors with a shape to give storage to, but 0.weight and 0.bias (of "
        "LazyLinear) are uninitialized: a lazy module's shapes are set by its first forward. "
        "Run one forward first (inputs on meta of the right shape are enough, such as "
        "torch.empty(8, 128, device='meta')), or build the module's non-lazy form "
        "(nn.Linear for nn.LazyLinear). Nothing was changed."
    )
    with pytest.raises(dk.DeviceKitError, match=f"^{re.escape(expected)}$"):
        dk.materialize(model, "cpu")
    model(torch.empty(2, 5, device="meta"))  # the dry run the message names
    dk.materialize(model, "cpu")
    assert model[0].weight.shape == (3, 5)
    assert torch.isfinite(model(torch.ones(2, 5))).all()


# What the other entry points say of meta tensors.


def test_moving_a_meta_model_names_its_meta_tensors_and_materialize() -> None:
    model = on_meta()
    with pytest.raises(dk.TransferError) as caught:
        dk.to_device({"model": model}, "cpu")
    assert str(caught.value) == (
        "Cannot move data['model'] to cpu: 8 of its tensors are on the meta device (scale, "
        "embed.weight, norm.weight and 5 more), and tensors on the meta device have shapes but "
        "no data: give the model storage with devicekit.materialize(model, 'cpu'), which "
        "initialises it and names whatever no initialiser writes."
    )
    assert all(t.is_meta for t in model.state_dict().values())  # nothing half-moved
    assert dk.to_device(model, "meta") is model  # to meta itself: nothing to refuse


def test_the_checks_and_guard_name_materialize_for_meta_parameters() -> None:
    model = on_meta()
    with pytest.raises(dk.DeviceMismatchError) as caught:
        dk.check_same_device(model, torch.ones(1))
    assert "devicekit.materialize(model, 'cpu')" in str(caught.value)
    linear = nn.Linear(2, 2, device="meta")
    with dk.guard(linear), pytest.raises(dk.DeviceMismatchError) as caught:
        linear(torch.ones(2))
    message = str(caught.value)
    assert "are on meta" in message
    assert "devicekit.materialize(model, 'cpu')" in message
    assert "Move the inputs with devicekit.to_device(..., 'meta')" in message


def test_a_transformers_model_built_on_meta_from_its_config() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    # Without the model's own initialiser: RMSNorm has no reset_parameters, and nothing
    # computes the rotary frequencies again.
    with pytest.raises(dk.DeviceKitError) as caught:
        dk.materialize(model, "cpu")
    for path in ("model.norm.weight", "model.layers.1.input_layernorm.weight", "inv_freq"):
        assert path in str(caught.value)
    assert "model.embed_tokens.weight" not in str(caught.value)  # Embedding's own reset
    # The model's own initialiser, as from_pretrained applies it; what it leaves (the
    # rotary frequencies computed in __init__, where it does) is named, then given.
    try:
        dk.materialize(model, "cpu", init=model._init_weights)
        refused = ""
    except dk.DeviceKitError as error:
        refused = str(error)
    if refused:  # this transformers release's _init_weights leaves the frequencies
        assert "rotary_emb.inv_freq" in refused
        assert all(t.is_meta for t in model.state_dict().values())

        def init(module: nn.Module) -> None:
            model._init_weights(module)
            if hasattr(module, "rope_init_fn"):
                inv_freq, _ = module.rope_init_fn(module.config, "cpu")
                module.inv_freq.copy_(inv_freq)

        dk.materialize(model, "cpu", init=init)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


# FSDP2: two gloo ranks, each materializing its shards of one model.

# How each rank's script ends: one collective more (a rank hung in an earlier one fails
# the run at its timeout), then what it found, in a file of its own.
# How each rank's script begins: its group of two over gloo, a mesh, and a model of two
# layers of a script's own kind, each sharded with FSDP2. Indented as the scripts are:
# each is dedented after these are added to it.
RANK_PRELUDE = """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import devicekit as dk

    folder, rank = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))

    def two_sharded(layer):
        def sharded():
            with torch.device("meta"):
                model = nn.Sequential(layer(), layer())
            for each in model:
                fully_shard(each, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model

        return sharded
    """
REPORT_AND_EXIT = """
    seven = torch.tensor([7])
    dist.all_reduce(seven)
    found["then"] = seven.item()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as out:
        json.dump(found, out)
    sys.stdout.flush()
    os._exit(0)  # no teardown of the group: gloo's can wait on a peer that has left
    """


def _found_by_each_rank(
    script: str, tmp_path: Path, start_two_ranks: TwoRanks, timeout: float
) -> list[dict[str, Any]]:
    """Run ``script`` on two ranks; what each found, in rank order."""
    path = tmp_path / "ranks.py"
    path.write_text(script)
    result = start_two_ranks(path, tmp_path, timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


FSDP_SCRIPT = textwrap.dedent(
    RANK_PRELUDE
    + """

    def build(layers=3):
        return nn.Sequential(
            nn.Embedding(32, 16),
            *[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(layers)],
            nn.Linear(16, 32),
        )

    def init(module):  # the same values sharded or not: a function of the layer's shape
        if isinstance(module, (nn.Linear, nn.Embedding)):
            with torch.no_grad():
                full = torch.linspace(-0.5, 0.5, module.weight.numel()).reshape(module.weight.shape)
                weight = module.weight
                if hasattr(weight, "device_mesh"):  # a DTensor: this rank's shard of it
                    from torch.distributed.tensor import distribute_tensor
                    full = distribute_tensor(full, weight.device_mesh, weight.placements)
                weight.copy_(full)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()  # a CPU mesh's random init differs from unsharded

    found = {}
    with torch.device("meta"):
        model = build()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dk.materialize(model, "cpu", init=init)
    tokens = torch.arange(12).reshape(3, 4) % 32
    loss = model(tokens).float().pow(2).mean()
    loss.backward()
    found["loss"] = loss.item()
    found["grads finite"] = all(torch.isfinite(p.grad.full_tensor()).all().item()
                                for p in model.parameters())
    reference = build()
    reference.apply(init)
    found["unsharded loss"] = reference(tokens).float().pow(2).mean().item()
    weight = model[1][0].weight
    found["placements"] = [repr(p) for p in weight.placements]
    found["local rows"] = weight.to_local().shape[0]
    try:
        dk.check_same_device(model, torch.ones(1, device="meta"))
    except dk.DeviceMismatchError as error:
        found["mismatch"] = str(error)
    found["to meta"] = type(dk.to_device(weight, "meta")).__name__  # shapes only: allowed

    # A sharded parameter that no initialiser writes: both ranks refuse, neither hangs.
    class Scaled(nn.Linear):
        def __init__(self):
            super().__init__(16, 16)
            self.gain = nn.Parameter(torch.ones(16))

    with torch.device("meta"):
        broken = nn.Sequential(Scaled(), Scaled())
    for layer in broken:
        fully_shard(layer, mesh=mesh)
    fully_shard(broken, mesh=mesh)
    try:
        dk.materialize(broken, "cpu")
        found["refused"] = None
    except dk.DeviceKitError as error:
        found["refused"] = str(error)
    found["meta again"] = all(p.is_meta for p in broken.parameters())
    """
    + REPORT_AND_EXIT
)


@pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)
def test_fsdp2_shards_built_on_meta_are_materialized_on_each_rank(
    tmp_path: Path, start_two_ranks: TwoRanks
) -> None:
    found = _found_by_each_rank(FSDP_SCRIPT, tmp_path, start_two_ranks, timeout=300)
    for mine in found:
        assert math.isfinite(mine["loss"])
        assert mine["grads finite"]
        assert mine["loss"] == pytest.approx(mine["unsharded loss"], rel=1e-5)
        assert mine["placements"] == ["Shard(dim=0)"]
        assert mine["mismatch"].startswith(
            "Expected every tensor on one device, but found 2: cpu has "
            "FSDPSequential.0.weight ([Shard(dim=0)] on a 2-rank cpu mesh), "
        )
        assert mine["to meta"] == "DTensor"
        assert mine["local rows"] == 8
        assert mine["refused"] is not None
        assert "\n  0.gain\n  1.gain\n" in mine["refused"]
        assert mine["meta again"]
        assert mine["then"] == 14  # the group is still in step
    assert found[0]["loss"] == found[1]["loss"]
    assert found[0]["refused"] == found[1]["refused"]


AGREE_SCRIPT = textwrap.dedent(
    RANK_PRELUDE
    + """

    class Counted(nn.Linear):  # FSDP2 shards the parameters; the buffer stays a plain tensor
        def __init__(self):
            super().__init__(16, 16)
            self.register_buffer("seen", torch.empty(4))

    sharded = two_sharded(Counted)

    def outcome(model, init):
        try:
            dk.materialize(model, "cpu", init=init)
            return None
        except Exception as error:
            return [type(error).__name__, str(error)]

    found = {}
    model = sharded()

    def rank_0_only(module):  # a buffer written on one rank only
        if isinstance(module, Counted) and rank == 0:
            module.seen.zero_()

    found["one rank writes"] = outcome(model, rank_0_only)
    found["meta again"] = all(t.is_meta for t in model.state_dict().values())

    def raises_on_rank_1(module):
        if isinstance(module, Counted):
            module.seen.zero_()
            if rank == 1 and module is model[1]:
                raise KeyError("rank 1's own mistake")

    found["one rank raises"] = outcome(model, raises_on_rank_1)
    found["meta after raising"] = all(t.is_meta for t in model.state_dict().values())

    def both(module):
        if isinstance(module, Counted):
            module.seen.zero_()

    found["both write"] = outcome(model, both)
    loss = model(torch.ones(2, 16)).sum()  # the forward's all-gather: every rank is here
    loss.backward()
    found["loss"] = loss.item()

    # A sharded layer already real keeps its shard while the rest is initialised.
    model = sharded()
    model[0].to_empty(device="cpu")
    with torch.no_grad():
        model[0].weight.to_local().fill_(0.25)
    held = model[0].weight
    found["loaded kept"] = outcome(model, both)
    found["same shard"] = model[0].weight is held and bool((held.to_local() == 0.25).all())
    model(torch.ones(2, 16)).sum().backward()  # FSDP2 still holds the shard it kept
    found["kept grads"] = bool(torch.isfinite(held.grad.full_tensor()).all())

    # A replicated DTensor, a whole copy on each rank, 1 element of 4 written on both.
    from torch.distributed.tensor import DTensor, Replicate

    class Gains(nn.Module):
        def __init__(self):
            super().__init__()
            whole = torch.empty(4, device="meta")
            replicated = DTensor.from_local(whole, mesh, [Replicate()], run_check=False)
            self.gain = nn.Parameter(replicated)

        def reset_parameters(self):
            self.gain.to_local().data[0] = 1.0  # through .data: no write counted

    found["replicated"] = outcome(Gains(), None)
    """
    + REPORT_AND_EXIT
)


@pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)
def test_sharded_ranks_agree_when_one_rank_s_initialiser_writes_less_or_raises(
    tmp_path: Path, start_two_ranks: TwoRanks
) -> None:
    # A rank left waiting in a collective fails the test at the timeout (both ranks killed).
    found = _found_by_each_rank(AGREE_SCRIPT, tmp_path, start_two_ranks, timeout=240)
    # A plain buffer that rank 0's init writes and rank 1's does not: both refuse, alike.
    for mine in found:
        kind, said = mine["one rank writes"]
        assert kind == "DeviceKitError"
        assert "but 2 of 6 hold what the empty storage held" in said
        assert "\n  0.seen (on 1 of 2 ranks)\n  1.seen (on 1 of 2 ranks)\n" in said
        assert mine["meta again"]
    assert found[0]["one rank writes"] == found[1]["one rank writes"]
    # An init that raises on rank 1 only: rank 1 raises its own error, rank 0 names rank 1.
    assert found[1]["one rank raises"] == ["KeyError", '"rank 1\'s own mistake"']
    assert found[0]["one rank raises"] == [
        "DeviceKitError",
        (
            "Expected materialize to succeed on every rank, but rank 1 raised in init on '1' "
            "(FSDPCounted); its own error, raised there, says why. The module's meta tensors "
            "are back in place on every rank, as they were: fix what raised and call "
            "materialize again."
        ),
    ]
    for mine in found:
        assert mine["meta after raising"]
        assert mine["both write"] is None  # then, written on both, a step runs
        assert math.isfinite(mine["loss"])
        assert mine["loaded kept"] is None
        assert mine["same shard"]
        assert mine["kept grads"]
        assert mine["then"] == 14  # the group is still in step
        # Counted once per copy on the mesh, not once per rank.
        assert "\n  gain: 3 of 4 elements\n" in mine["replicated"][1]


LEFT_SCRIPT = textwrap.dedent(
    RANK_PRELUDE
    + """

    class Counted(nn.Linear):  # FSDP2 shards the parameters; the buffer stays a plain tensor
        def __init__(self):
            super().__init__(16, 16)
            self.register_buffer("steps", torch.empty(4, dtype=torch.int64))

        def reset_parameters(self):  # init= writes every tensor of the layer
            pass

    sharded = two_sharded(Counted)

    def outcome(model, init):
        try:
            dk.materialize(model, "cpu", init=init)
        except Exception as error:
            return [type(error).__name__, str(error)]
        held = [getattr(t, "_local_tensor", t) for t in model.state_dict().values()]
        return ["returned", sum(int(torch.isnan(t).sum()) for t in held if t.is_floating_point())]

    def whole(module):
        if isinstance(module, Counted):
            module.bias.zero_()
            module.steps.zero_()

    found = {}

    def rescaled(module):  # every rank's shard: a write counted, the filler kept
        whole(module)
        if isinstance(module, Counted):
            module.weight.mul_(0.5)

    found["rescaled"] = outcome(sharded(), rescaled)

    def rank_0_s_rows(module):  # counted on both ranks; written where rank 0 holds rows only
        whole(module)
        if isinstance(module, Counted):
            module.weight.mul_(1.0)
            if rank == 0:
                module.weight.to_local().fill_(0.5)

    found["rank 0's rows"] = outcome(sharded(), rank_0_s_rows)

    def first_step(module):  # a plain buffer, whole on each rank, set at one index
        if isinstance(module, Counted):
            module.bias.zero_()
            module.weight.fill_(0.5)
            module.steps[0] = 0

    found["first step"] = outcome(sharded(), first_step)
    """
    + REPORT_AND_EXIT
)


@pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)
def test_sharded_ranks_name_what_a_counted_write_left_on_any_rank_alike(
    tmp_path: Path, start_two_ranks: TwoRanks
) -> None:
    found = _found_by_each_rank(LEFT_SCRIPT, tmp_path, start_two_ranks, timeout=240)
    for case, lines in {
        "rescaled": "\n  0.weight, after an in-place write\n  1.weight, after an in-place write\n",
        "rank 0's rows": (  # rank 1's shard, half of each weight: its rows are named
            "\n  0.weight: 128 of 256 elements, after an in-place write\n"
            "  1.weight: 128 of 256 elements, after an in-place write\n"
        ),
        "first step": (
            "\n  0.steps: 3 of 4 elements, after an in-place write\n"
            "  1.steps: 3 of 4 elements, after an in-place write\n"
        ),
    }.items():
        for mine in found:  # every rank raises, none returns holding the filler
            kind, said = mine[case]
            assert kind == "DeviceKitError", (case, said)
            assert lines in said, (case, said)
        assert found[0][case] == found[1][case]  # one message on every rank
    for mine in found:
        assert mine["then"] == 14  # the group is still in step


DTENSOR_TO_CUDA = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    import devicekit as dk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    on_cpu = distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
    try:
        dk.to_device({"w": on_cpu}, "cuda:0")
    except dk.TransferError as error:
        print(error)
    """
)


@pytest.mark.cuda
def test_a_dtensor_is_refused_a_device_type_other_than_its_mesh_s(
    tmp_path: Path, fresh_python: str
) -> None:
    script = tmp_path / "to_cuda.py"
    script.write_text(DTENSOR_TO_CUDA)
    result = run_program([fresh_python, str(script)], timeout=120)
    assert result.stdout.strip() == (
        "Cannot move data['w'] to cuda:0: it is a DTensor ([Shard(dim=0)] on a 1-rank cpu "
        "mesh), whose shards live on its mesh's cpu devices; moved, it would hold a cuda "
        "shard on a cpu mesh, which collectives cannot use. Distribute it on a cuda mesh "
        "(init_device_mesh('cuda', ...)), or move tensor.full_tensor() for one plain tensor."
    ), result.stderr[-3000:]

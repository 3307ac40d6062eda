"""dk.materialize: meta models given storage and initialised, and what nothing wrote named.

Plain models on the CPU here; FSDP2-sharded ones in two gloo processes (the torchtitan
flow: build on meta, fully_shard each layer and the root, materialize, train a step).
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

import devicekit as dk

from .programs import run_program, run_two_ranks

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


# What the other entry points say of meta tensors.


def test_moving_a_meta_model_names_its_meta_tensors_and_materialize() -> None:
    model = on_meta()
    with pytest.raises(dk.TransferError) as caught:
        dk.to_device({"model": model}, "cpu")
    assert str(caught.value) == (
        "Cannot move data['model'] to cpu: 8 of its tensors are on the meta device, which has "
        "shapes but no data (scale, embed.weight, norm.weight, norm.bias, rotary.inv_freq "
        "and 3 more). Give them storage and initialise them with dk.materialize(module, "
        "'cpu'), which names whatever no initialiser writes."
    )
    assert all(t.is_meta for t in model.state_dict().values())  # nothing half-moved
    assert dk.to_device(model, "meta") is model  # to meta itself: nothing to refuse


def test_the_checks_and_guard_name_materialize_for_meta_parameters() -> None:
    model = on_meta()
    with pytest.raises(dk.DeviceMismatchError) as caught:
        dk.check_same_device(model, torch.ones(1))
    assert "devicekit.materialize(model, device)" in str(caught.value)
    linear = nn.Linear(2, 2, device="meta")
    with dk.guard(linear), pytest.raises(dk.DeviceMismatchError) as caught:
        linear(torch.ones(2))
    message = str(caught.value)
    assert "are on meta" in message
    assert "devicekit.materialize(model, device)" in message
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

FSDP_SCRIPT = textwrap.dedent(
    """
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
    seven = torch.tensor([7])
    dist.all_reduce(seven)
    found["then"] = seven.item()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as out:
        json.dump(found, out)
    sys.stdout.flush()
    os._exit(0)  # no teardown of the group: gloo's can wait on a peer that has left
    """
)


@pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)
def test_fsdp2_shards_built_on_meta_are_materialized_on_each_rank(tmp_path: Path) -> None:
    script = tmp_path / "fsdp.py"
    script.write_text(FSDP_SCRIPT)
    result = run_two_ranks(script, tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    found: list[dict[str, Any]] = [
        json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)
    ]
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
def test_a_dtensor_is_refused_a_device_type_other_than_its_mesh_s(tmp_path: Path) -> None:
    script = tmp_path / "to_cuda.py"
    script.write_text(DTENSOR_TO_CUDA)
    result = run_program([sys.executable, str(script)], timeout=120)
    assert result.stdout.strip() == (
        "Cannot move data['w'] to cuda:0: it is a DTensor ([Shard(dim=0)] on a 1-rank cpu "
        "mesh), whose shards live on its mesh's cpu devices; moved, it would hold a cuda "
        "shard on a cpu mesh, which collectives cannot use. Distribute it on a cuda mesh "
        "(init_device_mesh('cuda', ...)), or move tensor.full_tensor() for one plain tensor."
    ), result.stderr[-3000:]

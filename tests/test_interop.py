"""The objects other libraries hand a training loop, moved and checked with the real packages.

transformers, tensordict and torch_geometric come with the ``interop`` extra
(``pip install -e ".[test,interop]"``). Where one is missing the tests that need it are
skipped, unless DEVICEKIT_REQUIRE_INTEROP is set, as CI and ``nox -s interop`` set it:
there a missing package fails the run instead of passing it by skipping.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import devicekit as dk
from devicekit._loader import _staging

from .helpers import CPU, META, PinRecorder, require_package

# transformers: every model's output is a ModelOutput, an OrderedDict whose attributes
# mirror its items.


def test_a_model_output_gives_the_moved_tensor_through_every_view() -> None:
    outputs = require_package("transformers.modeling_outputs")
    hidden = torch.ones(2, 3)
    output = outputs.BaseModelOutput(last_hidden_state=hidden)
    moved = dk.to_device(output, META)
    assert type(moved) is outputs.BaseModelOutput
    for view in (
        moved["last_hidden_state"],
        moved.last_hidden_state,
        moved[0],
        moved.to_tuple()[0],
    ):
        assert view.device == META
    assert moved.hidden_states is None
    assert output.last_hidden_state is hidden  # the input is untouched


def test_a_copied_model_output_shares_nothing_with_the_input() -> None:
    outputs = require_package("transformers.modeling_outputs")
    output = outputs.BaseModelOutput(last_hidden_state=torch.zeros(2))
    copied = dk.to_device(output, CPU, copy=True)
    copied.last_hidden_state.add_(1)  # written through the attribute
    assert copied["last_hidden_state"].tolist() == [1.0, 1.0]
    assert output.last_hidden_state.tolist() == [0.0, 0.0]
    assert output["last_hidden_state"].tolist() == [0.0, 0.0]


def _gpt2_output() -> tuple[Any, Any]:
    """A tiny GPT-2 from its config, and its output for one batch: logits and a cache."""
    transformers = require_package("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        output = model(torch.tensor([[1, 2, 3]]), use_cache=True)
    assert type(output.past_key_values).__name__ == "DynamicCache"
    return model, output


def test_a_model_output_s_cache_is_seen_by_the_checks() -> None:
    _, output = _gpt2_output()
    logits_elsewhere = dk.to_device(output.logits, META)
    with pytest.raises(dk.DeviceMismatchError) as raised:
        dk.check_same_device({"logits": logits_elsewhere, "past": output.past_key_values})
    assert "data['past'].layers[0].keys" in str(raised.value)
    seen = dk.find_devices(output)
    assert "['past_key_values'].layers[1].values" in seen[CPU]


def test_a_model_output_s_cache_moves_in_place_and_the_model_runs_on_it() -> None:
    model, output = _gpt2_output()
    moved = dk.to_device(output, META)
    assert set(dk.find_devices(moved)) == {META}
    assert moved.past_key_values is output.past_key_values  # moved in place, as documented
    model = dk.to_device(model, META)
    with torch.no_grad():
        step = model(dk.to_device(torch.tensor([[4]]), META), past_key_values=moved.past_key_values)
    assert step.logits.device == META
    assert step.past_key_values.get_seq_length() == 4


def test_a_cache_cannot_be_copied_or_cast_and_says_so() -> None:
    _, output = _gpt2_output()
    with pytest.raises(dk.TransferError) as raised:
        dk.to_device(output, CPU, copy=True)
    assert str(raised.value).startswith(
        "Cannot move data['past_key_values'] with copy=True: a transformers DynamicCache "
        "moves in place"
    )
    kept = dk.to_device(output, CPU, dtype=torch.float16, skip_keys="past_key_values")
    assert kept.logits.dtype == torch.float16


# Every kind of cache layer transformers ships, each filled through its own methods: what
# their prefetch() leaves behind (a sliding window's tensor, a static layer's length, a
# hybrid layer's keys, linear-attention states in dicts, quantized pairs) moves too.


def _layer_kinds(cache_utils: Any) -> list[str]:
    """Every layer type a config can name, from transformers' own tables.

    The dummy layer (shared key-values) is named as configs name it: a "moe" layer.
    """
    kinds = {*cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, *cache_utils.STATIC_LAYER_TYPE_MAPPING}
    return sorted("moe" if kind == "dummy" else kind for kind in kinds)


def _filled(cache: Any) -> Any:
    """``cache`` with every layer initialised, through the methods a model calls."""
    cache_utils = require_package("transformers.cache_utils")
    states = torch.ones(1, 2, 3, 4)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, cache_utils.LinearAttentionCacheLayerMixin):
            cache.update_conv_state(torch.ones(1, 4, 3), index)
            cache.update_recurrent_state(torch.ones(1, 2, 4, 4), index)
        if hasattr(layer, "update_indexer"):
            cache.update_indexer(torch.ones(1, 3, 4), index)
        if not isinstance(layer, cache_utils.DummyLayer) and hasattr(layer, "keys"):
            layer.update(states, states)  # the cache's update would ask CUDA when offloading
    return cache


def _cache(kind: str) -> Any:
    transformers = require_package("transformers")
    cache_utils = require_package("transformers.cache_utils")
    kinds = _layer_kinds(cache_utils)
    config = transformers.PreTrainedConfig(
        layer_types=kinds, num_hidden_layers=len(kinds), sliding_window=2, attention_chunk_size=2
    )
    if kind == "static":
        return _filled(cache_utils.StaticCache(config=config, max_cache_len=8))
    if kind == "offloaded":
        return _filled(cache_utils.DynamicCache(config=config, offloading=True))
    if kind == "quantized":
        full = transformers.PreTrainedConfig(num_hidden_layers=2)
        return _filled(cache_utils.QuantizedCache(backend="fp8", config=full))
    if kind == "encoder-decoder":  # attention layers only: cross-attention takes no others
        attention = ["full_attention", "sliding_attention"]
        config = transformers.PreTrainedConfig(
            layer_types=attention, num_hidden_layers=2, sliding_window=2
        )
        return cache_utils.EncoderDecoderCache(
            _filled(cache_utils.DynamicCache(config=config)),
            _filled(cache_utils.DynamicCache(config=config)),
        )
    return _filled(cache_utils.DynamicCache(config=config))


def _layer_tensors(cache: Any) -> dict[str, torch.Tensor]:
    """Every tensor in a layer's attributes, by the path the checks give it (a walk of its own)."""
    found = {}
    parts = vars(cache) if not hasattr(cache, "layers") else {"": cache}
    for name, part in parts.items():
        for index, layer in enumerate(getattr(part, "layers", ())):
            for attribute, value in vars(layer).items():
                where = f"{name + '.' if name else ''}layers[{index}].{attribute}"
                if isinstance(value, torch.Tensor):
                    found[where] = value
                elif isinstance(value, dict | tuple | list):
                    items = value.items() if isinstance(value, dict) else enumerate(value)
                    found.update(
                        (f"{where}[{key!r}]", item)
                        for key, item in items
                        if isinstance(item, torch.Tensor)
                    )
    return found


@pytest.mark.parametrize("kind", ["dynamic", "static", "offloaded", "quantized", "encoder-decoder"])
def test_every_kind_of_cache_layer_moves_whole_and_the_checks_see_all_of_it(kind: str) -> None:
    cache_utils = require_package("transformers.cache_utils")
    cache = _cache(kind)
    tensors = _layer_tensors(cache)
    if kind not in ("quantized", "encoder-decoder"):  # every class transformers maps to
        kinds = {*cache_utils.DYNAMIC_LAYER_TYPE_MAPPING.values()}
        if kind == "static":
            kinds = {*cache_utils.STATIC_LAYER_TYPE_MAPPING.values()}
        assert {type(layer) for layer in cache.layers} == kinds
    seen = dk.find_devices(cache)
    assert set(seen) == {CPU}
    assert sorted(seen[CPU]) == sorted(tensors)  # every tensor, none twice
    assert dk.to_device({"past": cache}, META)["past"] is cache  # in place
    assert set(dk.find_devices(cache)) == {META}
    left = {where for where, tensor in _layer_tensors(cache).items() if tensor.device != META}
    assert left == set()
    assert len(_layer_tensors(cache)) == len(tensors)


def test_a_cache_s_new_tensors_are_never_taken_for_those_it_moved_before() -> None:
    # The call's memo knows tensors by id: a tensor it moved and then dropped (a sliding
    # window's, replaced in place) must not lend its id to the next layer's new keys.
    transformers = require_package("transformers")
    cache_utils = require_package("transformers.cache_utils")
    config = transformers.PreTrainedConfig(
        layer_types=["sliding_attention"] * 4, num_hidden_layers=4, sliding_window=2
    )
    for _ in range(20):  # ids are reused where memory is: each try a chance
        cache = cache_utils.DynamicCache(config=config)
        for layer in cache.layers:
            layer.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
        dk.to_device(cache, META)
        shapes = {(layer.keys.dim(), layer._sliding_window_tensor.dim()) for layer in cache.layers}
        assert shapes == {(4, 0)}


def test_caches_of_sliding_window_and_linear_attention_models_move_whole() -> None:
    transformers = require_package("transformers")
    sizes = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "vocab_size": 50}
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}
    torch.manual_seed(0)
    mistral = transformers.MistralForCausalLM(
        transformers.MistralConfig(**sizes, **heads, sliding_window=2, max_position_embeddings=16)
    ).eval()
    qwen3_next = transformers.Qwen3NextForCausalLM(
        transformers.Qwen3NextConfig(
            **sizes,
            **heads,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=2,
            linear_num_key_heads=1,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
        )
    ).eval()
    for model in (mistral, qwen3_next):
        with torch.no_grad():
            cache = model(torch.tensor([[1, 2, 3]]), use_cache=True).past_key_values
        tensors = _layer_tensors(cache)
        assert sorted(dk.find_devices(cache)[CPU]) == sorted(tensors)
        dk.to_device(cache, META)
        assert set(dk.find_devices(cache)) == {META}
        assert all(tensor.device == META for tensor in _layer_tensors(cache).values())
    layers = {type(layer).__name__ for model in (mistral, qwen3_next) for layer in cache.layers}
    assert "LinearAttentionLayer" in layers
    # The sliding-window model goes on from its moved cache, every tensor where it runs.
    with torch.no_grad():
        cache = mistral(torch.tensor([[1, 2, 3]]), use_cache=True).past_key_values
        dk.to_device(cache, META)
        step = dk.to_device(mistral, META)(
            dk.to_device(torch.tensor([[4]]), META), past_key_values=cache
        )
    assert step.logits.device == META
    assert cache.get_seq_length() == 4  # three tokens and the one it took on meta


def test_a_batch_encoding_is_rebuilt_item_by_item_not_moved_by_its_own_to() -> None:
    transformers = require_package("transformers")
    ids = torch.tensor([[101, 50257]])
    encoding = transformers.BatchEncoding({"input_ids": ids, "lengths": [torch.tensor([2])]})
    moved = dk.to_device(encoding, META, dtype=torch.float16)
    assert type(moved) is transformers.BatchEncoding
    assert moved["input_ids"].device == META
    assert moved["input_ids"].dtype == torch.int64  # token ids are never cast
    assert moved["lengths"][0].device == META  # BatchEncoding.to skips nested values
    assert moved.input_ids is moved["input_ids"]
    assert encoding["input_ids"] is ids


# tensordict: TensorDict (TorchRL's batch) and tensorclasses, each with a .to() that
# returns a new object.


def test_a_tensordict_moves_with_its_own_to_and_keeps_integers() -> None:
    tensordict = require_package("tensordict")
    labels = torch.tensor([70001, 3])
    batch = tensordict.TensorDict(
        {"obs": torch.ones(2, 3), "labels": labels, "next": {"reward": torch.ones(2, 1)}},
        batch_size=[2],
    )
    moved = dk.to_device(batch, META, dtype=torch.float16)
    assert isinstance(moved, tensordict.TensorDict)
    assert moved.device == META
    assert moved["obs"].dtype == torch.float16
    assert moved["next", "reward"].dtype == torch.float16
    assert moved["labels"].dtype == torch.int64  # not cast
    assert batch["obs"].device == CPU  # the input is untouched
    assert batch["obs"].dtype == torch.float32
    exact = dk.to_device(batch, CPU, dtype=torch.float64)
    assert exact["labels"].tolist() == [70001, 3]


def test_a_tensordict_batch_arrives_through_the_loader() -> None:
    tensordict = require_package("tensordict")
    batches = [
        tensordict.TensorDict({"obs": torch.full((2, 3), float(i))}, batch_size=[2])
        for i in range(3)
    ]
    loader = dk.DeviceDataLoader(batches, META)
    moved = list(loader)
    assert [batch["obs"].device for batch in moved] == [META] * 3
    assert all(batch["obs"].device == CPU for batch in batches)


def test_a_tensorclass_keeps_its_integer_labels_and_its_paths_are_its_fields() -> None:
    tensordict = require_package("tensordict")

    @tensordict.tensorclass
    class Sample:
        image: torch.Tensor
        label: torch.Tensor

    sample = Sample(image=torch.ones(2, 3), label=torch.tensor([70001, 5]), batch_size=[2])
    cast = dk.to_device({"sample": sample}, CPU, dtype=torch.float16)["sample"]
    assert type(cast) is Sample
    assert cast.image.dtype == torch.float16
    assert cast.label.dtype == torch.int64
    assert cast.label.tolist() == [70001, 5]  # float16 would have made it inf
    assert sample.image.dtype == torch.float32
    assert dk.find_devices({"sample": sample}) == {CPU: ["['sample'].image", "['sample'].label"]}


# torch_geometric: Data.to moves in place and returns self.


def _graph() -> Any:
    data = require_package("torch_geometric.data")
    return data.Data(x=torch.ones(3, 2), edge_index=torch.tensor([[0, 1], [1, 2]]))


def test_a_graph_is_moved_on_a_copy_and_the_input_never_changes() -> None:
    graph = _graph()
    x = graph.x
    moved = dk.to_device({"graph": graph}, META)["graph"]
    assert moved is not graph
    assert moved.x.device == META
    assert moved.edge_index.device == META
    assert graph.x is x  # still the input's own tensor, on the host
    assert graph.x.device == CPU


def test_a_batch_and_a_heterogeneous_graph_are_moved_on_copies() -> None:
    data = require_package("torch_geometric.data")
    batch = data.Batch.from_data_list([_graph(), _graph()])
    hetero = data.HeteroData()
    hetero["paper"].x = torch.ones(2, 4)
    hetero["paper", "cites", "paper"].edge_index = torch.tensor([[0], [1]])
    moved_batch, moved_hetero = dk.to_device([batch, hetero], META)
    assert moved_batch.x.device == META
    assert moved_batch.batch.device == META
    assert moved_hetero["paper"].x.device == META
    assert batch.x.device == CPU
    assert hetero["paper"].x.device == CPU
    assert hetero["paper", "cites", "paper"].edge_index.device == CPU


def test_a_loader_over_graphs_leaves_its_dataset_on_the_host() -> None:
    graphs = [_graph() for _ in range(4)]
    loader = dk.DeviceDataLoader(DataLoader(graphs, batch_size=None), META)
    for _ in range(2):  # two epochs: the dataset is still the host's
        assert all(graph.x.device == META for graph in loader)
    assert all(graph.x.device == CPU for graph in graphs)


def test_a_graph_takes_dtype_on_its_features_only() -> None:
    moved = dk.to_device(_graph(), CPU, dtype=torch.float16)
    assert moved.x.dtype == torch.float16
    assert moved.edge_index.dtype == torch.int64


def test_graph_paths_are_the_names_users_write() -> None:
    data = require_package("torch_geometric.data")
    graph = _graph()
    assert dk.find_devices({"graph": graph}) == {CPU: ["['graph'].x", "['graph'].edge_index"]}
    hetero = data.HeteroData()
    hetero["paper"].x = torch.ones(2, 4, device=META)
    hetero["paper", "cites", "paper"].edge_index = torch.tensor([[0], [1]])
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.check_same_device(hetero)
    assert info.value.devices == {
        META: ["data['paper'].x"],
        CPU: ["data['paper', 'cites', 'paper'].edge_index"],
    }


def test_requiring_interop_packages_fails_where_one_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEVICEKIT_REQUIRE_INTEROP", "1")
    with pytest.raises(ModuleNotFoundError, match=re.escape("no_such_package_here")):
        require_package("no_such_package_here")


def test_objects_that_move_themselves_are_pinned_by_their_own_pin_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As torch's pin-memory thread does: a TensorDict, a graph batch, a PackedSequence.
    tensordict = require_package("tensordict")
    geometric = require_package("torch_geometric.data")
    recorder = PinRecorder()
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: recorder(self))
    features = torch.ones(4, 3)
    batches = {
        "tensordict": tensordict.TensorDict({"x": features}, batch_size=[4]),
        "graph": geometric.Batch.from_data_list(
            [geometric.Data(x=features, edge_index=torch.tensor([[0, 1], [1, 2]]))]
        ),
        "packed": torch.nn.utils.rnn.pack_sequence([features]),
    }
    graph_features = batches["graph"].x
    for name, batch in batches.items():
        recorder.pinned.clear()
        pool = _staging.StagingPool(None, 2, _staging.PAGEABLE.allocate)
        stager = _staging.Stager(pool, threads=1)
        # The feed's pinning: what moves itself is pinned by itself, on a shallow copy.
        pinned = stager.stage({"batch": batch, "id": 3}, threading.Event()).batch
        assert (4, 3) in [tuple(tensor.shape) for tensor in recorder.pinned], name
        assert type(pinned["batch"]) is type(batch)
        assert pinned["batch"] is not batch
    assert batches["graph"].x is graph_features  # pinned on a copy: the input is unchanged


def test_samples_of_tensordict_and_graph_batches_are_counted() -> None:
    tensordict = require_package("tensordict")
    geometric = require_package("torch_geometric.data")
    loader_module = require_package("torch_geometric.loader")
    batches = [tensordict.TensorDict({"x": torch.ones(4, 3)}, batch_size=[4])] * 3
    loader = dk.DeviceDataLoader(batches, CPU)
    for _batch in loader:
        pass
    assert loader.stats.samples == 12
    graphs = [
        geometric.Data(x=torch.ones(3, 2), edge_index=torch.tensor([[0, 1], [1, 2]]))
        for _ in range(10)
    ]
    loader = dk.DeviceDataLoader(loader_module.DataLoader(graphs, batch_size=4), CPU)
    for _batch in loader:
        pass
    assert loader.stats.samples == 10  # graphs: the DataLoader's batch_size, the last short


@pytest.mark.parametrize("device", [None, "cpu"], ids=["no-device", "with-device"])
def test_skip_keys_reach_inside_a_tensordict_at_any_depth(device: str | None) -> None:
    tensordict = require_package("tensordict")
    raw, inner_raw = torch.ones(2), torch.zeros(2)
    inner = tensordict.TensorDict({"raw": inner_raw, "y": torch.ones(2)}, batch_size=[2])
    batch = tensordict.TensorDict(
        {"x": torch.ones(2), "raw": raw, "inner": inner}, batch_size=[2], device=device
    )
    moved = dk.to_device({"batch": batch}, META, skip_keys="raw")["batch"]
    assert moved["raw"] is raw
    assert moved["inner", "raw"] is inner_raw
    assert moved["x"].device == META
    assert moved["inner", "y"].device == META
    assert moved.device is None  # it holds values on two devices now
    assert batch.device == (None if device is None else CPU)  # the input is unchanged
    assert batch["x"].device == CPU

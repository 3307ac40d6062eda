"""Each name of devicekit._base._compat run against the installed PyTorch.

_compat holds what devicekit reads of PyTorch's private names, versions and messages.
Each test here makes PyTorch do the real thing (save and load a pickle, raise its own
error, trace a function) and fails where a PyTorch release changes what devicekit reads.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import io
import os
import pickle
import re
import threading
import zipfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from devicekit._base import _compat

from .helpers import META, own_safe_globals  # noqa: F401 - a fixture, used by name


def _pickled(obj: object) -> bytes:
    """The pickle torch.save writes for ``obj``: the archive's data.pkl."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return zipfile.ZipFile(buffer).read("archive/data.pkl")


def _loads_weights_only(obj: object, allowing: Sequence[Any] = ()) -> bool:
    """Whether PyTorch's own weights-only load reads back what torch.save wrote for ``obj``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals(list(allowing)):
        try:
            torch.load(buffer, weights_only=True)
        except pickle.UnpicklingError:
            return False
    return True


def _refusal_of_load(obj: object, allowing: Sequence[Any] = ()) -> str:
    """torch.load's own words for refusing what torch.save wrote for ``obj``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    with (
        torch.serialization.safe_globals(list(allowing)),
        pytest.raises(pickle.UnpicklingError) as raised,
    ):
        torch.load(buffer, weights_only=True)
    return str(raised.value)


class Config:
    def __init__(self) -> None:
        self.lr = 0.1


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.Adam(torch.nn.Linear(2, 2).parameters())


def _stepped_optimizer() -> torch.optim.Optimizer:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # its state, a defaultdict, now holds items
    return optimizer


@pytest.mark.parametrize(
    "state",
    [
        {"weight": torch.ones(2), "step": 3, "name": "run", "raw": b"\x00", "z": 1j},
        {"ids": {1, 2}, "frozen": frozenset({1})},
        {"config": Config()},
        {"args": argparse.Namespace(lr=0.1)},
        {"best": np.float32(0.5)},
        torch.nn.Linear(2, 2).state_dict(),
        {"big": 2**3000},
    ],
    ids=["plain", "sets", "own-class", "namespace", "numpy", "state-dict", "huge-int"],
)
def test_the_save_time_check_agrees_with_a_weights_only_load(state: Any) -> None:
    # Without devicekit's allowlist, the check and PyTorch's own load must agree.
    assert (_compat.weights_only_refusal(_pickled(state)) is None) == _loads_weights_only(state)


@pytest.mark.parametrize(
    ("state", "allowing"),
    [
        (collections.defaultdict(list, a=[1]), [collections.defaultdict, list]),
        (collections.defaultdict(list), [collections.defaultdict, list]),
        (collections.defaultdict(list), [collections.defaultdict]),
        ({"config": Config()}, [Config]),
        ({"config": Config()}, []),
        (_stepped_optimizer(), [torch.optim.SGD, collections.defaultdict, dict]),
        (_optimizer(), [torch.optim.Adam, collections.defaultdict, dict]),
        ({"weight": torch.ones(2), "ids": {1, 2}}, []),
        ([collections.UserList([1])], [collections.UserList, list]),
    ],
    ids=[
        "defaultdict",
        "empty-defaultdict",
        "its-factory-not-allowed",
        "allowed-class",
        "class-not-allowed",
        "stepped-optimizer",
        "optimizer",
        "plain",
        "userlist",
    ],
)
@pytest.mark.usefixtures("own_safe_globals")
def test_the_trial_build_agrees_with_a_weights_only_load(state: Any, allowing: list[Any]) -> None:
    loads = _loads_weights_only(state, allowing)
    before = torch.serialization.get_safe_globals()
    tried = _compat.weights_only_build_refusal(_pickled(state), allowing)
    assert (tried is None) == loads
    assert torch.serialization.get_safe_globals() == before  # the process's list untouched


_MODEL_CLASSES = [
    "torch.nn.modules.container.Sequential",
    "torch.nn.modules.sparse.Embedding",
    "torch.nn.modules.dropout.Dropout",
    "torch.nn.modules.rnn.LSTM",
    "torch.nn.modules.linear.Linear",
]


@pytest.mark.usefixtures("own_safe_globals")
def test_the_globals_refused_are_those_torch_names_in_the_order_first_written() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Dropout(0.2), nn.LSTM(4, 4), nn.Linear(4, 10))
    state = {"counts": collections.defaultdict(list), "model": model}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    pickled = zipfile.ZipFile(buffer).read("archive/data.pkl")
    refused = _compat.weights_only_refused_globals(pickled)
    assert refused == ["collections.defaultdict", "builtins.list", *_MODEL_CLASSES]
    buffer.seek(0)
    assert set(refused) == set(torch.serialization.get_unsafe_globals_in_checkpoint(buffer))
    with torch.serialization.safe_globals([collections.defaultdict, list]):
        assert _compat.weights_only_refused_globals(pickled) == _MODEL_CLASSES
    assert _compat.weights_only_refused_globals(b"\x80\x02\x95") == []  # no pickle of torch's


class _Commands:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("true",))  # never run: the load refuses it unread


@pytest.mark.usefixtures("own_safe_globals")
def test_torch_load_s_refusals_are_read_as_it_words_them() -> None:
    relu = _compat.weights_only_said(_refusal_of_load({"act": nn.ReLU()}))
    assert relu.names == ["torch.nn.modules.activation.ReLU"]
    assert relu.blocked is None
    assert relu.reason.startswith(
        "Unsupported global: GLOBAL torch.nn.modules.activation.ReLU was not an allowed global"
    )  # the unpickler's own words, torch.load's advice (in bold) left out
    assert "\x1b" not in relu.reason
    assert "weights_only" not in relu.reason.split(". ")[0]

    commands = _compat.weights_only_said(_refusal_of_load(_Commands()))
    assert commands.blocked == f"{os.system.__module__}.system"  # posix.system, or nt.system
    assert commands.names == [commands.blocked]

    # Classes allowed as globals, but built by an operation the load keeps for dicts.
    filled = collections.defaultdict(list, a=[1])
    built = _compat.weights_only_said(_refusal_of_load(filled, [collections.defaultdict, list]))
    assert built.names == ["collections.defaultdict"]
    assert built.reason.startswith("Can only SETITEM for dict")


@pytest.mark.usefixtures("own_safe_globals")
def test_the_save_time_refusal_is_read_naming_every_global() -> None:
    refusal = _compat.weights_only_refusal(_pickled({"a": nn.ReLU(), "b": nn.Tanh()}))
    assert refusal is not None
    assert _compat.weights_only_said(refusal) == (
        ["torch.nn.modules.activation.ReLU", "torch.nn.modules.activation.Tanh"],
        None,
        refusal,
    )


def _archive(records: dict[str, bytes]) -> io.BytesIO:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in records.items():
            archive.writestr(name, data)
    buffer.seek(0)
    return buffer


def _without(record: str) -> io.BytesIO:
    """A checkpoint of torch.save's with one record left out."""
    buffer = io.BytesIO()
    torch.save({"weight": torch.ones(4)}, buffer)
    with zipfile.ZipFile(buffer) as archive:
        return _archive({n: archive.read(n) for n in archive.namelist() if n != record})


@pytest.mark.parametrize(
    "archive",
    [
        _archive({"notes.txt": b"hello"}),
        _without("archive/data.pkl"),
        _without("archive/data/0"),
    ],
    ids=["no-folder", "no-pickle", "no-tensor-data"],
)
def test_torch_load_s_words_for_an_archive_that_is_no_whole_checkpoint_are_recognised(
    archive: io.BytesIO,
) -> None:
    with pytest.raises(RuntimeError) as raised:
        torch.load(archive, weights_only=True)
    assert _compat.is_unreadable_archive(raised.value)


def test_other_errors_are_no_unreadable_archive() -> None:
    with pytest.raises(RuntimeError) as raised:
        torch.ones(2) @ torch.ones(3)
    assert not _compat.is_unreadable_archive(raised.value)
    assert not _compat.is_unreadable_archive(OSError("PytorchStreamReader"))  # not torch's


def test_the_registered_table_gives_the_tensor_registered_now() -> None:
    norm = nn.BatchNorm1d(2)
    weights, running = (_compat.registered_table(norm, n) for n in ("weight", "running_mean"))
    norm.weight = nn.Parameter(torch.zeros(2))  # replaced, as Module.to does for some moves
    norm.running_mean = torch.ones(2)
    assert weights["weight"] is norm.weight
    assert running["running_mean"] is norm.running_mean
    assert dict(norm.named_parameters(recurse=False)) == {
        "weight": weights["weight"],
        "bias": weights["bias"],
    }


def test_the_current_accelerator_is_torch_accelerator_s_without_starting_it() -> None:
    found = _compat.current_accelerator()
    assert found == torch.accelerator.current_accelerator(check_available=False)
    assert "check_available" in inspect.signature(torch.accelerator.current_accelerator).parameters
    if found is None:  # a CPU build: no family says it has a device
        assert not torch.accelerator.is_available()


def test_a_dispatch_mode_sees_each_aten_call_with_its_arguments() -> None:
    seen: list[tuple[Any, tuple[Any, ...]]] = []

    class Recorder(_compat.DispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
        ) -> Any:
            seen.append((func, args))
            return func(*args, **(kwargs or {}))

    host = torch.ones(2)
    with Recorder():  # type: ignore[no-untyped-call]
        moved = host.to(META)
    assert moved.device == META
    assert [(func, args[0]) for func, args in seen] == [(torch.ops.aten._to_copy.default, host)]


def test_ddp_forward_syncs_reads_what_ddp_s_forward_decides_by() -> None:
    # Read in DDP's source: no process group to start (tests/test_fit_batch.py runs one).
    source = inspect.getsource(nn.parallel.DistributedDataParallel)
    assert "if torch.is_grad_enabled() and self.require_backward_grad_sync:" in source
    assert "self.will_sync_module_buffers()" in source


def test_the_profiler_s_session_is_seen_from_a_thread_it_does_not_profile() -> None:
    seen: list[bool] = []

    def look() -> None:
        seen.append(_compat.profiler_running())

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        thread = threading.Thread(target=look)
        thread.start()
        thread.join(timeout=30)
    look()
    assert seen == [True, False]


def test_pieces_cut_under_the_guard_are_tensors_of_their_own_to_autograd() -> None:
    guard = _compat.independent_pieces()
    assert guard is not None
    weight = torch.ones(2, requires_grad=True)

    def step(cut: Any) -> None:
        with cut():
            first, second = torch.zeros(4).split(2)
        loss = (second * weight).sum()  # saves second for the backward
        first.add_(1)  # an in-place change to its neighbour
        loss.backward()

    step(guard)
    assert weight.grad is not None
    assert torch.equal(weight.grad, torch.zeros(2))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step(contextlib.nullcontext)  # plain views of one tensor: one version counter


def test_a_custom_pruning_method_s_attribute_is_known_as_recomputed() -> None:
    class Halves(prune.BasePruningMethod):
        PRUNING_TYPE = "unstructured"

        def compute_mask(self, t: torch.Tensor, default_mask: torch.Tensor) -> torch.Tensor:
            return default_mask * (torch.arange(t.numel()).reshape(t.shape) % 2)

    layer = nn.Linear(2, 2)
    Halves.apply(layer, "weight")
    assert _compat.recomputed_attributes(layer) == {"weight"}
    parametrized = nn.utils.parametrizations.orthogonal(nn.Linear(2, 2))
    assert _compat.recomputed_attributes(parametrized) == frozenset()  # a property, no hook


def test_a_host_allocation_that_fails_is_no_device_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as raised:
        torch.empty(2**62, dtype=torch.uint8)  # more than any host has
    assert not _compat.is_out_of_memory(raised.value)
    assert issubclass(torch.OutOfMemoryError, RuntimeError)


@pytest.mark.cuda
def test_a_cuda_allocation_that_fails_is_a_device_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as raised:
        torch.empty(2**50, dtype=torch.uint8, device="cuda")
    assert _compat.is_out_of_memory(raised.value)


@pytest.mark.parametrize(
    "mixed",
    [
        pytest.param(lambda: torch.ones(2, device=META) + torch.ones(2), id="add"),
        pytest.param(lambda: torch.cat([torch.ones(2, device=META), torch.ones(2)]), id="cat"),
        pytest.param(
            lambda: torch.where(torch.ones(2, dtype=torch.bool, device=META), 1.0, torch.ones(2)),
            id="where",
        ),
        pytest.param(
            lambda: nn.LSTM(2, 2)(torch.ones(1, 1, 2), (torch.ones(1, 1, 2, device=META),) * 2),
            id="lstm",
        ),
        pytest.param(
            lambda: torch.ones(2, 2, device="cuda") @ torch.ones(2, 2),
            id="matmul",
            marks=pytest.mark.cuda,
        ),
        pytest.param(
            lambda: nn.Conv2d(1, 1, 1).cuda()(torch.ones(1, 1, 2, 2)),
            id="conv",
            marks=pytest.mark.cuda,
        ),
        pytest.param(
            lambda: nn.Linear(2, 2)(torch.ones(1, 2, device="cuda")),
            id="linear",
            marks=pytest.mark.cuda,
        ),
        pytest.param(
            lambda: torch.ones(3)[torch.zeros(1, dtype=torch.long, device="cuda")],
            id="indexing",
            marks=pytest.mark.cuda,
        ),
    ],
)
def test_pytorch_s_own_errors_for_mixed_devices_are_recognised(mixed: Any) -> None:
    with pytest.raises(RuntimeError) as raised:
        mixed()
    assert _compat.is_device_mismatch(raised.value), str(raised.value)


def test_the_compiler_runs_marked_functions_and_passes_their_errors_to_the_user() -> None:
    # run_while_tracing marks one_graph and raise_past_the_compiler; traced, they run in
    # Python, and the error reaches the user as raised, not wrapped by the compiler.
    def checked(x: torch.Tensor) -> torch.Tensor:
        if _compat.one_graph():
            _compat.raise_past_the_compiler(ValueError, "Expected no call in one graph.")
        return x + 1

    one_graph = torch.compile(checked, fullgraph=True, backend="eager")
    with pytest.raises(ValueError, match=re.escape("Expected no call in one graph.")) as raised:
        one_graph(torch.ones(1))
    assert str(raised.value).startswith("Expected no call in one graph.")
    broken = torch.compile(checked, fullgraph=False, backend="eager")
    assert torch.equal(broken(torch.ones(1)), torch.full((1,), 2.0))


def test_applying_a_change_to_a_module_s_own_tensors_is_module_apply_s() -> None:
    # What Module.to and to_empty do to each module: its own parameters and buffers only,
    # a parameter's requires_grad kept; a submodule's left for its own call.
    model = nn.Sequential(nn.BatchNorm1d(2))
    model.register_buffer("scale", torch.ones(2))
    model[0].weight.requires_grad_(False)
    seen: list[tuple[int, ...]] = []

    def doubled(tensor: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(tensor.shape))
        return tensor * 2

    _compat.apply_to_own_tensors(model, doubled)
    assert seen == [(2,)]  # the Sequential's own buffer, not its child's
    assert torch.equal(model.scale, torch.full((2,), 2.0))
    _compat.apply_to_own_tensors(model[0], doubled)
    assert torch.equal(model[0].running_var, torch.full((2,), 2.0))
    assert isinstance(model[0].weight, nn.Parameter)
    assert not model[0].weight.requires_grad


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
@pytest.mark.parametrize(
    "layout",
    [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc],
)
def test_a_sparse_tensor_s_bytes_are_its_parts_as_a_copy_moves_them(layout: torch.layout) -> None:
    blocked = layout in (torch.sparse_bsr, torch.sparse_bsc)
    sparse = torch.eye(4).to_sparse(layout=layout, blocksize=(2, 2) if blocked else None)
    parts = [getattr(sparse, part)() for part in _compat._SPARSE_PARTS[layout]]
    assert _compat.stored_bytes(sparse) == sum(part.nbytes for part in parts)
    assert sum(part.numel() for part in parts[-1:]) == sparse.values().numel()  # values last
    # Why the parts are read: PyTorch refuses to say, or says the dense tensor's bytes.
    if layout is torch.sparse_coo:
        with pytest.raises(RuntimeError, match="nbytes is not defined for sparse tensors"):
            _ = sparse.nbytes
    else:
        assert sparse.nbytes == torch.eye(4).nbytes != _compat.stored_bytes(sparse)


# A device type registered from Python: what the stand-in of devicekit.testing reads.


def test_this_pytorch_takes_python_backends_and_names_privateuse1() -> None:
    assert _compat.python_backends()  # PyTorch 2.13, as CI installs it
    assert _compat.privateuse1_name() in ("privateuseone", "standin")  # renamed once started
    assert int(torch._C._autograd.DeviceType.PrivateUse1) == _compat.privateuse1_number()


def test_an_operator_s_arguments_come_apart_and_back_with_their_schema() -> None:
    x = torch.ones(2)
    leaves, spec = _compat.op_leaves(((x, [x, 2]), {"alpha": 3}))
    assert leaves[0] is x
    assert len(leaves) == 4
    assert _compat.op_rebuilt(leaves, spec) == ((x, [x, 2]), {"alpha": 3})
    schema = _compat.op_schema(torch.ops.aten.add_.Tensor)
    assert [arg.name for arg in schema.arguments] == ["self", "other", "alpha"]
    assert schema.returns[0].alias_info.is_write


def test_a_tensor_s_text_is_pytorch_s_with_values_read_elsewhere() -> None:
    shown = torch.tensor([1.5, 2.0], requires_grad=True) * 1
    assert _compat.tensor_text(shown, torch.tensor([3.0, 4.0])) == (
        "tensor([3., 4.], grad_fn=<MulBackward0>)"
    )


def test_a_wrapper_tensor_takes_its_shape_strides_and_device() -> None:
    class Shaped(torch.Tensor):
        __torch_dispatch__ = classmethod(lambda cls, *args, **kwargs: NotImplemented)

    like = torch.ones(2, 3).t()
    made = _compat.wrapper_tensor(Shaped, like, torch.device("meta"))
    assert (type(made), made.shape, made.stride(), made.device) == (
        Shaped,
        like.shape,
        like.stride(),
        torch.device("meta"),
    )


def test_a_function_not_traced_runs_eagerly_inside_a_compiled_one() -> None:
    seen: list[bool] = []

    @_compat.not_traced
    def body(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return x + 1

    compiled = torch.compile(lambda x: body(x) * 2, backend="eager")
    assert compiled(torch.ones(1)).tolist() == [4.0]
    assert seen == [False]  # run, not traced into the graph

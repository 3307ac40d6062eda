"""to_device under torch.compile: the eager result, or a devicekit error at trace time.

meta is the second device on CPU machines; the eager backend runs the traced graph.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from collections import OrderedDict, deque
from typing import Any

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit._base import _compat

from .helpers import CPU, META, Pair
from .programs import run_program


def _compiled(fn: Any, *, fullgraph: bool = True) -> Any:
    return torch.compile(fn, fullgraph=fullgraph, backend="eager")


def test_to_device_compiles_with_fullgraph_on_the_common_containers() -> None:
    shared = torch.ones(2)
    batch = {"a": shared, "b": [shared, (torch.arange(3), Pair(torch.ones(1), 7))], "s": "x"}
    moved = _compiled(lambda b: dk.to_device(b, "meta", dtype=torch.float16))(batch)
    eager = dk.to_device(batch, "meta", dtype=torch.float16)
    assert moved["a"] is moved["b"][0]  # aliases kept
    assert type(moved["b"][1][1]) is Pair
    assert moved["b"][1][1].y == 7
    assert moved["s"] == "x"
    for got, want in ((moved["a"], eager["a"]), (moved["b"][1][0], eager["b"][1][0])):
        assert (got.device, got.dtype, got.shape) == (want.device, want.dtype, want.shape)


@pytest.mark.parametrize(
    "options",
    [
        {"copy": True},
        {"memory_format": torch.channels_last},
        {"skip_keys": "raw", "device": META},
        {"dtype": torch.float16},
        {"non_blocking": False},
    ],
)
def test_the_compiled_to_device_takes_every_option_as_eagerly(options: dict[str, Any]) -> None:
    torch._dynamo.reset()
    shared = torch.ones(2)
    batch = {
        "x": shared,
        "again": shared,
        "image": torch.ones(1, 3, 2, 2),
        "raw": torch.ones(1),
        "ordered": OrderedDict(a=torch.ones(1)),
        "pair": Pair(torch.ones(1), 3),
        "ids": torch.tensor([70001]),
    }
    options = dict(options)
    device = options.pop("device", CPU)
    eager = dk.to_device(batch, device, **options)
    compiled = _compiled(lambda b: dk.to_device(b, device, **options))(batch)
    assert type(compiled["ordered"]) is OrderedDict
    assert type(compiled["pair"]) is Pair
    assert compiled["x"] is compiled["again"]
    for key in ("x", "image", "raw", "ids"):
        mine, theirs = compiled[key], eager[key]
        assert (mine.dtype, mine.shape, mine.is_contiguous(memory_format=torch.channels_last)) == (
            theirs.dtype,
            theirs.shape,
            theirs.is_contiguous(memory_format=torch.channels_last),
        )
        assert (mine is batch[key]) == (theirs is batch[key]), key
    assert compiled["ordered"]["a"].dtype == eager["ordered"]["a"].dtype
    assert compiled["ids"].dtype == torch.int64


class CountingBackend:
    """A torch.compile backend that runs the graph as it is and counts the compilations."""

    def __init__(self) -> None:
        self.compiled = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.compiled += 1
        return graph.forward


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"dtype": torch.float16},
        {"copy": True},
        {"memory_format": torch.channels_last},
        {"non_blocking": True},
        {"non_blocking": False},
        {"strict": True},
        {"skip_keys": "raw"},
        {"device": META, "dtype": torch.bfloat16},
    ],
    ids=repr,
)
def test_fresh_batches_of_one_structure_compile_once_with_every_option(
    options: dict[str, Any],
) -> None:
    torch._dynamo.reset()
    options = dict(options)
    device = options.pop("device", CPU)
    backend = CountingBackend()
    step = torch.compile(
        lambda b: dk.to_device(b, device, **options), fullgraph=True, backend=backend
    )
    for _ in range(12):  # each batch fresh, as a DataLoader makes them
        shared = torch.randn(2)
        batch = {
            "x": shared,
            "again": shared,
            "image": torch.randn(1, 3, 2, 2),
            "raw": torch.randn(1),
            "ids": torch.arange(3),
            "pair": Pair(torch.randn(1), 3),
        }
        moved = step(batch)
        eager = dk.to_device(batch, device, **options)
        assert moved["x"] is moved["again"]
        for key in ("x", "image", "raw", "ids"):
            assert (moved[key].device, moved[key].dtype) == (eager[key].device, eager[key].dtype)
            if not moved[key].is_meta:
                assert torch.equal(moved[key], eager[key])
    assert backend.compiled == 1


def test_a_dataclass_first_met_inside_a_compiled_region_is_refused_then_traced() -> None:
    @dataclasses.dataclass
    class Fresh:
        x: torch.Tensor

    torch._dynamo.reset()
    msg = "devicekit meets the type"
    with pytest.raises(Exception, match=re.escape(msg)):
        _compiled(lambda b: dk.to_device(b, CPU, dtype=torch.float16))([Fresh(torch.ones(1))])
    dk.to_device(Fresh(torch.ones(1)), CPU)  # met once, outside
    torch._dynamo.reset()
    moved = _compiled(lambda b: dk.to_device(b, CPU, dtype=torch.float16))([Fresh(torch.ones(1))])
    assert type(moved[0]) is Fresh
    assert moved[0].x.dtype == torch.float16


# Refusals: devicekit's own errors, at trace time, as eagerly.


def test_the_compiled_to_device_refuses_options_as_eagerly() -> None:
    torch._dynamo.reset()
    msg = "Expected dtype to be None or a floating-point dtype"
    with pytest.raises(Exception, match=re.escape(msg)):
        _compiled(lambda b: dk.to_device(b, CPU, dtype=torch.int64))({"x": torch.ones(1)})


def test_what_the_compiler_cannot_repeat_is_refused_at_trace_time_with_a_devicekit_error() -> None:
    torch._dynamo.reset()
    module = nn.Linear(1, 1)
    msg = "Cannot move data['model'] inside torch.compile: a Linear moves in place, as"
    with pytest.raises(Exception, match=re.escape(msg)):
        _compiled(lambda b: dk.to_device(b, CPU))({"model": module})
    # Without fullgraph, the compiler leaves that call to Python: the eager result.
    torch._dynamo.reset()
    assert _compiled(lambda b: dk.to_device(b, CPU), fullgraph=False)({"model": module}) == {
        "model": module
    }
    torch._dynamo.reset()
    msg = "Cannot move data inside torch.compile to the current device"
    with pytest.raises(Exception, match=re.escape(msg)):
        _compiled(dk.to_device)({"x": torch.ones(1)})


class Handle:
    """An object that neither moves nor is a plain scalar: strict=True refuses it."""


@pytest.mark.parametrize(
    ("call", "data", "error", "said"),
    [
        (
            lambda b: dk.to_device(b, CPU, non_blocking="yes"),
            torch.ones(1),
            TypeError,
            "Expected non_blocking to be 'auto', True or False, got 'yes'.",
        ),
        (
            lambda b: dk.to_device(b, CPU),
            {"model": nn.Linear(1, 1)},
            dk.TransferError,
            "Cannot move data['model'] inside torch.compile: a Linear moves in place",
        ),
        (
            lambda b: dk.to_device(b, CPU),
            [nn.utils.rnn.pack_sequence([torch.ones(2, 1)])],
            dk.TransferError,
            "Cannot move data[0] inside torch.compile: a PackedSequence moves with its .to()",
        ),
        (
            lambda b: dk.to_device(b, CPU, strict=True),
            {"x": torch.ones(1), "handle": Handle()},
            dk.TransferError,
            "Cannot move data['handle']: it is a tests.test_compiled.Handle",
        ),
        (
            lambda b: dk.to_device(b, "gpu"),
            torch.ones(1),
            dk.DeviceUnavailableError,
            "Expected a device such as 'cpu'",
        ),
        (
            lambda b: dk.to_device(b, 7),
            torch.ones(1),
            dk.DeviceUnavailableError,
            "Expected an accelerator for the device index 7",
        ),
    ],
    ids=["bad-option", "module", "packed-sequence", "strict", "gpu", "index"],
)
def test_devicekit_s_refusals_reach_the_user_as_its_own_errors_under_fullgraph(
    call: Any, data: Any, error: type[Exception], said: str
) -> None:
    torch._dynamo.reset()
    with pytest.raises(error) as raised:
        torch.compile(call, fullgraph=True, backend="eager")(data)
    assert str(raised.value).startswith(said)


def test_a_deque_is_refused_in_a_compiled_region_with_devicekit_s_reason() -> None:
    # The compiler reads an input deque's maxlen as None (PyTorch 2.13): its copy would
    # not be the same deque.
    torch._dynamo.reset()
    batch = deque([torch.ones(1), torch.zeros(1)], maxlen=3)
    with pytest.raises(
        dk.TransferError, match=re.escape("Cannot move data inside torch.compile: it is a deque")
    ):
        _compiled(lambda b: dk.to_device(b, CPU, dtype=torch.float16))(batch)
    assert dk.to_device(batch, CPU).maxlen == 3


def test_data_too_deep_for_the_compiler_is_a_devicekit_error_and_fine_eagerly() -> None:
    deep: Any = torch.ones(1)
    for _ in range(200):
        deep = [deep]
    torch._dynamo.reset()
    with pytest.raises(dk.TransferError, match="it nests more than 64 containers deep"):
        _compiled(lambda b: dk.to_device(b, CPU))(deep)
    assert dk.to_device(deep, META) is not deep


def test_without_fullgraph_a_refusal_breaks_the_graph_and_the_call_runs_eagerly() -> None:
    torch._dynamo.reset()
    packed = nn.utils.rnn.pack_sequence([torch.ones(2, 1)])
    moved = _compiled(lambda b: dk.to_device(b, META), fullgraph=False)([packed])
    assert moved[0].data.is_meta
    assert moved[0].batch_sizes.is_cpu


def test_run_while_tracing_marks_a_function_as_torch_s_assume_constant_result_does() -> None:
    # devicekit sets the mark itself (torch.compiler's helper imports dynamo, about a
    # second): a PyTorch that marks constants otherwise fails here, not in a user's graph.
    def mine() -> int:
        return 1

    def theirs() -> int:
        return 1

    _compat.run_while_tracing(mine)
    torch.compiler.assume_constant_result(theirs)  # type: ignore[no-untyped-call]
    marks = {name for name in vars(theirs) if "dynamo" in name}
    assert marks
    assert {name: vars(mine).get(name) for name in marks} == {
        name: vars(theirs)[name] for name in marks
    }


def test_skip_keys_compile_with_fullgraph_where_the_skip_set_is_new_to_the_process(
    fresh_python: str,
) -> None:
    # A fresh process: no eager call has made the skip set's view, so the first compiled
    # call makes one while the compiler traces (which takes no lock), and the eager calls
    # after it, which store and fill a view of their own, make it compile nothing again.
    program = textwrap.dedent(
        """
        import torch
        import devicekit as dk

        compiled = []
        def backend(graph, example_inputs):
            compiled.append(graph)
            return graph.forward

        step = torch.compile(
            lambda b: dk.to_device(b, "meta", skip_keys="raw"), fullgraph=True, backend=backend
        )
        for _ in range(3):  # fresh batches of one structure
            raw, inner_raw = torch.zeros(2), torch.ones(1)
            batch = {"x": torch.ones(2), "raw": raw, "n": [{"raw": inner_raw, "y": torch.ones(1)}]}
            moved = step(batch)
            eager = dk.to_device(batch, "meta", skip_keys="raw")
            for got in (moved, eager):
                assert got["raw"] is raw and got["n"][0]["raw"] is inner_raw
                assert got["x"].device == got["n"][0]["y"].device == torch.device("meta")
        print(sorted(moved), sorted(moved["n"][0]) == sorted(eager["n"][0]), len(compiled))
        """
    )
    result = run_program([fresh_python, "-c", program], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "['n', 'raw', 'x'] True 1\n"

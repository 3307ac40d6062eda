"""PyTorch's private names, version shims and message patterns that devicekit reads, in one place.

No other module of devicekit names them. Each is a named function or type here, with a
test in ``tests/test_compat.py`` run against the installed PyTorch, so that an upgrade
that moves one fails there, not in a user's checkpoint: an upgrade is one file to read.
Each is in PyTorch 2.6 and later unless its docstring says which versions differ.
"""

from __future__ import annotations

import io
import pickle
import re
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, NoReturn, TypeVar, cast

import torch

# The base of track_transfers' recorder: the only way to see each aten call with its
# arguments; and the weights-only load's module, whose scan and loop the checks below
# reuse. Both loaded by torch itself, so naming them here costs nothing at import.
from torch import _weights_only_unpickler
from torch.utils._python_dispatch import TorchDispatchMode as DispatchMode

__all__ = [
    "DdpSync",
    "DispatchMode",
    "WeightsOnlySaid",
    "apply_to_own_tensors",
    "current_accelerator",
    "ddp_forward_syncs",
    "independent_pieces",
    "is_device_mismatch",
    "is_out_of_memory",
    "is_unreadable_archive",
    "not_traced",
    "one_graph",
    "op_leaves",
    "op_rebuilt",
    "op_schema",
    "own_tensors",
    "privateuse1_name",
    "privateuse1_number",
    "profiler_running",
    "python_backends",
    "raise_past_the_compiler",
    "recomputed_attributes",
    "register_python_backend",
    "registered_table",
    "run_while_tracing",
    "scaler_between_steps",
    "scaler_marks_kept",
    "stored_bytes",
    "swap_on_module_conversion",
    "tensor_text",
    "version_of",
    "weights_only_build_refusal",
    "weights_only_refusal",
    "weights_only_refused_globals",
    "weights_only_said",
    "wrapper_tensor",
]


def weights_only_refusal(pickled: bytes) -> str | None:
    """Why a weights-only load would refuse this pickle of ``torch.save``'s; None if it would not.

    Read by PyTorch's own scan of what the load looks up; its globals checked against
    those the load allows now (PyTorch's and ``add_safe_globals``'). Nothing is built:
    about a fifth of the save of a model's state (a dry run of the load: twice the save).
    Worded as the load words it: ``"Unsupported global: GLOBAL module.Name ..."``.
    """
    try:
        refused = sorted(_refused_globals(pickled))
    except pickle.UnpicklingError as unknown:  # an operation the load does not know
        return str(unknown)
    if not refused:
        return None
    more = f" (and {', '.join(refused[1:])})" if len(refused) > 1 else ""
    return f"Unsupported global: GLOBAL {refused[0]} was not an allowed global{more}"


_LOADER: Any = _weights_only_unpickler  # partly untyped


def _refused_globals(pickled: bytes) -> set[str]:
    """The globals the pickle names that a weights-only load refuses now, by PyTorch's scan."""
    named: set[str] = _LOADER.get_globals_in_pkl(io.BytesIO(pickled))
    return named.difference(_LOADER._get_allowed_globals(), _LOADER._get_user_allowed_globals())


F = TypeVar("F", bound=Callable[..., Any])


def run_while_tracing(fn: F) -> F:
    """Mark ``fn`` as torch.compile's ``assume_constant_result`` does, without importing dynamo.

    The compiler then calls ``fn`` in Python while it traces, its result a constant of
    the graph. ``torch.compiler.assume_constant_result`` imports ``torch._dynamo`` (about
    a second) to set this one attribute; marked here, ``import devicekit`` stays light.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


_passing: dict[type[Exception], type[Exception]] = {}


def _passed_through(kind: type[Exception]) -> type[Exception]:
    """``kind``, made an error torch.compile hands to the user as it is.

    Dynamo wraps an error raised while it traces unless it is a ``UserError``; this
    subclass of both keeps ``kind`` for ``except`` clauses and its message first.
    """
    from torch._dynamo import exc  # noqa: PLC0415 - loaded already: a region is tracing

    def init(self: Any, message: str) -> None:
        Exception.__init__(self, message)
        self.error_type = exc.UserErrorType.INVALID_INPUT
        self.message = message
        self.case_name = None

    if kind not in _passing:
        namespace = {"__init__": init, "__module__": kind.__module__}
        _passing[kind] = type(kind.__name__, (kind, exc.UserError), namespace)
    return _passing[kind]


@run_while_tracing
def one_graph() -> bool:
    """Whether the region being traced must be one graph (``fullgraph=True``).

    There a graph break is an error; elsewhere an error raised in traced code breaks the
    graph, and the call runs eagerly, where it succeeds or raises the same error itself.
    """
    from torch._dynamo.symbolic_convert import InstructionTranslator  # noqa: PLC0415

    try:
        tracer = InstructionTranslator.current_tx()
        return bool(tracer.one_graph or getattr(tracer, "error_on_graph_break", False))
    except AttributeError:  # no tracer to ask: say one graph, where the error is clearest
        return True


@run_while_tracing
def raise_past_the_compiler(kind: type[Exception], message: str) -> NoReturn:
    """Raise ``kind(message)`` from a compiled region so that it reaches the user as it is.

    Called in traced code, it runs in Python while the compiler traces (see
    :func:`run_while_tracing`), where an error it raises leaves the compiler unwrapped.
    """
    raise _passed_through(kind)(message)


def recomputed_attributes(module: Any) -> frozenset[str]:
    """The plain attributes of ``module`` that PyTorch's own forward pre-hooks recompute.

    ``torch.nn.utils.prune`` (any ``BasePruningMethod``, containers included) and the
    older ``weight_norm`` and ``spectral_norm`` set the tensor they reparametrise before
    every forward from registered tensors, which ``Module.to()`` moves. Their hook classes
    are read from modules already imported: one never imported installed no hook.
    (``parametrize`` needs nothing here: its tensor is a property.)

    >>> import torch
    >>> from torch.nn.utils import prune
    >>> pruned = prune.l1_unstructured(torch.nn.Linear(2, 2), "weight", amount=0.5)
    >>> recomputed_attributes(pruned), recomputed_attributes(torch.nn.Linear(2, 2))
    (frozenset({'weight'}), frozenset())
    """
    hooks = module._forward_pre_hooks  # private: where register_forward_pre_hook keeps them
    if not hooks:
        return frozenset()

    def loaded(where: str, name: str) -> tuple[type, ...]:
        kind = getattr(sys.modules.get(where), name, None)
        return (kind,) if isinstance(kind, type) else ()

    pruning = loaded("torch.nn.utils.prune", "BasePruningMethod")
    named = loaded("torch.nn.utils.weight_norm", "WeightNorm")
    named += loaded("torch.nn.utils.spectral_norm", "SpectralNorm")
    found = set()
    for hook in hooks.values():
        if isinstance(hook, pruning):
            found.add(getattr(hook, "_tensor_name", None))
        elif isinstance(hook, named):
            found.add(getattr(hook, "name", None))
    return frozenset(name for name in found if isinstance(name, str))


_OUT_OF_MEMORY_SAID = (
    "CUDA out of memory",  # the caching allocator's words, raised as RuntimeError by extensions
    "HIP out of memory",  # the same on ROCm
    "CUDA error: out of memory",  # cudaErrorMemoryAllocation: memory the allocator does not own
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS could not allocate its handle or workspace
    "HIPBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "MPS backend out of memory",  # MPS raises a RuntimeError of its own
    "XPU out of memory",  # so did XPU builds before torch.OutOfMemoryError
)
_CHAIN_MOST = 32
"""The most exceptions of a chain looked at: a chain is short; a longer one is a loop."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a device running out of memory, or was raised because one did.

    ``torch.OutOfMemoryError``, or a RuntimeError in the words listed above. An error
    raised *from* one (its ``__cause__`` chain) is one too; one raised while one was
    handled, without ``from``, is another error (a ``KeyError`` in an ``except`` block)
    and must reach the user. The host running out (``MemoryError``) is not a device's.

    >>> import torch
    >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    True
    >>> try:
    ...     try:
    ...         raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling ...")
    ...     except RuntimeError as failed:
    ...         raise ValueError("the attention kernel failed") from failed
    ... except ValueError as wrapped:
    ...     is_out_of_memory(wrapped)
    True
    >>> try:
    ...     try:
    ...         raise torch.OutOfMemoryError("CUDA out of memory")
    ...     except torch.OutOfMemoryError:
    ...         {}["batch_size"]  # a mistake of the handler: no device out of memory
    ... except KeyError as mistake:
    ...     is_out_of_memory(mistake)
    False
    >>> is_out_of_memory(MemoryError()), is_out_of_memory(RuntimeError("CUDA error: launch failed"))
    (False, False)
    """
    seen: set[int] = set()
    each: BaseException | None = error
    while each is not None and id(each) not in seen and len(seen) < _CHAIN_MOST:
        seen.add(id(each))
        if isinstance(each, torch.OutOfMemoryError):
            return True
        if isinstance(each, RuntimeError):
            try:
                said = str(each)
            except Exception:  # a message that cannot be read says nothing
                said = ""
            if any(words in said for words in _OUT_OF_MEMORY_SAID):
                return True
        each = each.__cause__
    return False


class DdpSync(NamedTuple):
    """What a forward of a DistributedDataParallel module synchronises across ranks."""

    gradients: bool
    """In the backward that follows: its gradient all-reduce."""
    buffers: bool
    """In the forward itself: its buffers, broadcast from rank 0."""


def ddp_forward_syncs(module: Any) -> DdpSync:
    """What a forward of the DistributedDataParallel ``module`` begun now would synchronise.

    Read as DDP's forward decides it, from two undocumented though unprefixed names:
    gradients where autograd records and ``require_backward_grad_sync`` (not under
    ``no_sync()``); buffers as ``will_sync_module_buffers()`` says (the first forward
    under ``no_sync()`` still broadcasts them, the later ones do not).
    """
    gradients = torch.is_grad_enabled() and bool(module.require_backward_grad_sync)
    return DdpSync(gradients, bool(module.will_sync_module_buffers()))


def weights_only_build_refusal(pickled: bytes, allowing: Iterable[Any] = ()) -> str | None:
    """Why a weights-only load would stop building this pickle of torch.save's; None if not.

    What :func:`weights_only_refusal` cannot see: a ``defaultdict`` holding items is
    refused even where allowed. Built by the load's own loop, tensors on meta, with
    ``allowing`` (as ``add_safe_globals`` takes it) added for this build alone: another
    thread's load meanwhile allows nothing more. Only the load's refusals
    (``pickle.UnpicklingError``) are reported; a built class's own error passes through.

    >>> import collections, io, torch, zipfile
    >>> def pickled(obj):
    ...     buffer = io.BytesIO()
    ...     torch.save(obj, buffer)
    ...     return zipfile.ZipFile(buffer).read("archive/data.pkl")
    >>> filled = pickled(collections.defaultdict(list, a=[]))
    >>> weights_only_build_refusal(filled, [collections.defaultdict, list]).split(", but")[0]
    'Can only SETITEM for dict, collections.OrderedDict, collections.Counter'
    >>> empty = pickled(collections.defaultdict(list))
    >>> weights_only_build_refusal(empty, [collections.defaultdict, list]) is None
    True
    """
    added = {}
    for each in allowing:  # as add_safe_globals takes them: a global, or (global, its name)
        value, name = each if isinstance(each, tuple) else (each, None)
        added[name or f"{value.__module__}.{value.__qualname__}"] = value

    # The load's loop, run with its own module's names but the allowlist above; its
    # list of sparse tensors to check after a load is a fresh one (meta tensors here).
    names = {
        **vars(_LOADER),
        "_get_user_allowed_globals": lambda: {**_LOADER._get_user_allowed_globals(), **added},
        "_sparse_tensors_to_validate": [],
    }
    load = types.FunctionType(_LOADER.Unpickler.load.__code__, names, "load")

    def meta_storage(saved_id: tuple[Any, ...]) -> Any:
        kind, numel = saved_id[1], saved_id[4]
        dtype = torch.uint8 if kind is torch.UntypedStorage else kind.dtype
        storages: Any = torch.storage  # untyped constructors
        data = storages.UntypedStorage(numel * dtype.itemsize, device="meta")
        return storages.TypedStorage(wrap_storage=data, dtype=dtype, _internal=True)

    unpickler = _LOADER.Unpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = meta_storage
    try:
        load(unpickler)
    except pickle.UnpicklingError as refused:
        return str(refused).strip()
    return None


_DEVICE_MISMATCH_SAID = (
    "Expected all tensors to be on the same device",  # c10, TensorIterator, fake tensors
    "is not on the expected device",  # reference ops, as on meta: "Tensor on device meta is ..."
    "tensors are not at the same device",  # the RNNs: "Input and hidden tensors are not at ..."
    "to have the same device as tensor for",  # cuDNN's argument checks
    "indices should be either on",  # indexing: "... on cpu or on the same device as ..."
    "Placeholder storage has not been allocated on MPS device",  # a host tensor in an MPS op
)
# cuDNN's and oneDNN's convolutions name the two tensors' types, which say their devices:
# "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the
# same", or "(CPUFloatType) and ... (CUDAFloatType)"; types that differ in dtype only are
# not a mismatch of devices.
_TYPES_SAID = re.compile(r"Input type \((?P<a>[^)]*)\) and \w+ type \((?P<b>[^)]*)\) should be")
_TYPE_FAMILIES = ("cuda", "hip", "mps", "xpu", "meta")


def _type_family(name: str) -> str:
    lowered = name.lower()
    return next((family for family in _TYPE_FAMILIES if family in lowered), "cpu")


def is_device_mismatch(error: BaseException) -> bool:
    """Whether ``error`` is PyTorch refusing an operation on tensors on different devices.

    By PyTorch's words, listed above by where each check is made. Only the error itself
    is read, not the errors it was raised from.

    >>> import torch
    >>> try:
    ...     torch.ones(2, device="meta") + torch.ones(2)
    ... except RuntimeError as error:
    ...     is_device_mismatch(error)
    True
    >>> said = "Input type ({}) and weight type (torch.cuda.FloatTensor) should be the same"
    >>> is_device_mismatch(RuntimeError(said.format("torch.FloatTensor")))
    True
    >>> is_device_mismatch(RuntimeError(said.format("torch.cuda.DoubleTensor")))  # dtypes only
    False
    >>> is_device_mismatch(RuntimeError("mat1 and mat2 shapes cannot be multiplied (1x3 and 4x2)"))
    False
    """
    if not isinstance(error, RuntimeError):
        return False
    try:
        said = str(error)
    except Exception:  # a message that cannot be read says nothing
        return False
    if any(words in said for words in _DEVICE_MISMATCH_SAID):
        return True
    types = _TYPES_SAID.search(said)
    return types is not None and _type_family(types["a"]) != _type_family(types["b"])


def weights_only_refused_globals(pickled: bytes) -> list[str]:
    """Every global of this pickle of torch.save's that a weights-only load refuses, at once.

    In the order the pickle first names them, as the load names them (``module.Name``,
    ``__builtin__.set`` as ``builtins.set``). Allowed and read as in
    :func:`weights_only_refusal`, which says why where this is empty.

    >>> import collections, io, torch, zipfile
    >>> buffer = io.BytesIO()
    >>> torch.save(torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.ReLU()), buffer)
    >>> weights_only_refused_globals(zipfile.ZipFile(buffer).read("archive/data.pkl"))
    ['torch.nn.modules.container.Sequential', 'torch.nn.modules.linear.Linear', \
'torch.nn.modules.activation.ReLU']
    """
    import pickletools  # noqa: PLC0415 - on a refusal only

    try:
        refused = _refused_globals(pickled)
    except (pickle.UnpicklingError, EOFError):  # an operation the load does not know
        return []
    ordered: dict[str, None] = {}
    try:
        for operation, argument, _ in pickletools.genops(pickled):
            if operation.name == "GLOBAL":  # "module name", as the load reads it
                lines = io.BytesIO(str(argument).replace(" ", "\n", 1).encode() + b"\n")
                module, name = _LOADER._read_global_instruction(lines.readline)
                if f"{module}.{name}" in refused:
                    ordered[f"{module}.{name}"] = None
    except Exception:  # the scan above read it: only the order would be lost
        ordered = {}
    return [*ordered, *sorted(refused - ordered.keys())]


def profiler_running() -> bool:
    """Whether a torch.profiler session is running, in any thread.

    The session's flag, not the thread's (``torch.autograd._profiler_enabled``), which
    says False in our threads to a session with ``profile_all_threads``.

    >>> import torch
    >>> profiler_running()
    False
    >>> with torch.profiler.profile():
    ...     profiler_running()
    True
    """
    return torch.autograd.profiler._is_profiler_enabled


def independent_pieces() -> Callable[[], Any] | None:
    """The guard under which views of one tensor are tensors of their own to autograd.

    ``torch._C._AutoDispatchBelowADInplaceOrView``: pieces cut under it share no version
    counter and carry no multi-output-view restrictions. None where PyTorch lacks it
    (packing is then off).

    >>> import torch
    >>> guard = independent_pieces()
    >>> whole = torch.zeros(4)
    >>> with guard():
    ...     a, b = whole.split(2)
    >>> a._base is None, a._version == whole._version
    (True, True)
    """
    return getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)


_COLOURS = re.compile(r"\x1b\[[0-9;]*m")  # torch.load's advice puts a warning in bold
_GLOBAL_SAID = re.compile(r"GLOBAL (\S+)|<class '([^']+)'>")
_MORE_SAID = re.compile(r"was not an allowed global \(and ([^)]*)\)")
_BLOCKED_SAID = re.compile(r"GLOBAL (\S+) whose module \S+ is blocked")
_ADVICE_ENDS = "WeightsUnpickler error:"  # torch.load's advice, then the unpickler's words


class WeightsOnlySaid(NamedTuple):
    """What a weights-only load's refusal says, read from its words."""

    names: list[str]
    """The globals named: ``GLOBAL module.Name``, or a class not built (``<class '...'>``)."""
    blocked: str | None
    """A global of a module the load never allows (``posix.system``), which no list allows."""
    reason: str
    """The unpickler's own words, without torch.load's advice and colours."""


def weights_only_said(message: str) -> WeightsOnlySaid:
    """Read the refusal of a weights-only load: torch.load's, or :func:`weights_only_refusal`'s.

    >>> weights_only_said("GLOBAL a.B was not an allowed global (and c.D, e.F)").names
    ['a.B', 'c.D', 'e.F']
    """
    text = _COLOURS.sub("", message)
    first = _GLOBAL_SAID.search(text)
    names = [] if first is None else [first.group(1) or first.group(2)]
    more = _MORE_SAID.search(text)
    names += more.group(1).split(", ") if more else []
    blocked = _BLOCKED_SAID.search(text)
    reason = text.rsplit(_ADVICE_ENDS, maxsplit=1)[-1].strip()
    return WeightsOnlySaid(names, None if blocked is None else blocked.group(1), reason)


_UNREADABLE_SAID = ("PytorchStreamReader", "zip archive", "enforce fail", "file not found")


def is_unreadable_archive(error: BaseException) -> bool:
    """Whether ``error`` is torch.load's reader saying the archive is no whole checkpoint.

    A RuntimeError in its zip reader's words (``"PytorchStreamReader failed reading zip
    archive"``, or a failed check: ``"[enforce fail at ...]"``).
    """
    return isinstance(error, RuntimeError) and any(
        words in str(error) for words in _UNREADABLE_SAID
    )


def registered_table(module: torch.nn.Module, name: str) -> dict[str, Any]:
    """The table of ``module``'s own in which its parameter or buffer ``name`` is registered.

    ``Module._parameters`` or ``_buffers``: ``table.get(name)`` is the tensor registered
    now (``Module.to`` replaces some), a dict lookup where listing them costs microseconds.
    """
    return module._parameters if name in module._parameters else module._buffers


def own_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's own parameters, then its own buffers, by name, a tensor held twice twice.

    What ``named_parameters(recurse=False, remove_duplicate=False)`` and ``named_buffers``
    list, read from ``Module._parameters`` and ``_buffers``: on 1,000 modules 3.4 ms
    instead of 10.6 ms (each of those calls walks the submodules to keep only the first).

    >>> [name for name, _ in own_tensors(torch.nn.BatchNorm1d(2))]
    ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked']
    >>> [name for name, _ in own_tensors(torch.nn.Linear(2, 2, bias=False))]
    ['weight']
    """
    return [
        (name, tensor)
        for table in (module._parameters, module._buffers)
        for name, tensor in table.items()
        if tensor is not None
    ]


def current_accelerator() -> torch.device | None:
    """This PyTorch build's accelerator, as ``torch.accelerator`` names it, without starting it.

    2.7 and later take ``check_available=False``; 2.6 does not, and raises where no
    accelerator is available. None where the build has none.
    """
    current: Any = torch.accelerator.current_accelerator  # its 2.6 signature, untyped here
    try:
        found = current(check_available=False)
    except TypeError:  # PyTorch 2.6: no check_available
        try:
            found = current()
        except RuntimeError:
            found = None
    return None if found is None else torch.device(found)


def apply_to_own_tensors(
    module: torch.nn.Module, change: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Replace a module's own parameters and buffers by ``change(tensor)``, as ``to_empty`` does.

    ``Module._apply``, not recursing: the path ``Module.to`` and ``to_empty`` take, which
    FSDP2's modules extend to keep their sharded parameters' references right; a plain
    ``setattr`` would leave those pointing at the old tensors.
    """
    module._apply(change, recurse=False)  # type: ignore[no-untyped-call]


def scaler_between_steps(scaler: torch.amp.GradScaler) -> None:
    """Empty ``scaler``'s record of the step under way, as its ``update()`` does; nothing else.

    ``GradScaler._per_optimizer_states``: each optimizer's stage (unscaled, stepped) and
    the infinities found. ``update()`` empties it; ``load_state_dict()`` does not, so a step
    stopped after ``unscale_()`` makes the next one refuse to unscale again. The scale and
    the growth tracker stay as they are. A disabled scaler keeps no record.

    >>> import torch
    >>> model, scaler = torch.nn.Linear(2, 1), torch.amp.GradScaler("cpu", init_scale=8.0)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    >>> scaler.unscale_(optimizer)  # and then the step ran out of memory
    >>> scaler_between_steps(scaler)
    >>> scaler.unscale_(optimizer)
    >>> scaler.step(optimizer)
    >>> scaler.update()
    >>> scaler.get_scale()
    8.0
    """
    record = getattr(scaler, "_per_optimizer_states", None)  # absent where disabled
    if record is not None:
        record.clear()


_SCALER_MARKS = ("grad_scale", "found_inf")


def scaler_marks_kept(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """What puts back, as they are now, the attributes ``GradScaler.step()`` sets on ``optimizer``.

    ``grad_scale`` and ``found_inf``, set for an optimizer that unscales in its own step
    (``_step_supports_amp_scaling``: the fused Adam, AdamW and SGD), and deleted once that
    step returns. A step stopped inside keeps them, and the next multiplies its scale by
    the one left: the gradients divided by the scale twice.

    >>> import torch
    >>> model, scaler = torch.nn.Linear(2, 1), torch.amp.GradScaler("cpu")
    >>> optimizer = torch.optim.Adam(model.parameters(), fused=True)
    >>> put_back = scaler_marks_kept(optimizer)
    >>> def out_of_memory(*_):
    ...     raise torch.OutOfMemoryError("CUDA out of memory")
    >>> hook = optimizer.register_step_pre_hook(out_of_memory)
    >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    >>> try:
    ...     scaler.step(optimizer)
    ... except torch.OutOfMemoryError:
    ...     hasattr(optimizer, "grad_scale")
    True
    >>> put_back()
    >>> hasattr(optimizer, "grad_scale")
    False
    """
    own = vars(optimizer)
    kept = {name: own[name] for name in _SCALER_MARKS if name in own}

    def put_back() -> None:
        for name in _SCALER_MARKS:
            if name in kept:
                own[name] = kept[name]
            else:
                own.pop(name, None)

    return put_back


def version_of(tensor: torch.Tensor) -> int | None:
    """How many in-place writes PyTorch has counted on ``tensor`` (``Tensor._version``).

    Shared by its views and by ``detach()``; a write through ``.data`` is not counted,
    nor, on a DTensor, one made on its local shard (that shard counts its own). None for
    an inference tensor (made under ``torch.inference_mode``), which keeps no count.

    >>> import torch
    >>> tensor = torch.zeros(3)
    >>> before = version_of(tensor)
    >>> _ = tensor[:2].fill_(1.0)
    >>> version_of(tensor) - before
    1
    >>> _ = tensor.data.fill_(2.0)  # through .data: not counted
    >>> version_of(tensor) - before
    1
    >>> with torch.inference_mode():
    ...     version_of(torch.zeros(1)) is None
    True
    """
    try:
        return tensor._version
    except RuntimeError:  # "Inference tensors do not track version counter."
        return None


_SPARSE_PARTS: dict[torch.layout, tuple[str, ...]] = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` holds, as a copy of it moves them: ``nbytes``, or its parts'.

    ``Tensor.nbytes`` refuses a sparse COO tensor and gives a compressed one's dense size;
    a sparse tensor's are its indices' and values' (``_indices``/``_values`` for COO:
    the public ones refuse an uncoalesced tensor).

    >>> import torch
    >>> stored_bytes(torch.zeros(4))
    16
    >>> stored_bytes(torch.eye(3).to_sparse())  # 2 x 3 int64 indices, 3 float32 values
    60
    """
    parts = _SPARSE_PARTS.get(tensor.layout)
    if parts is None:
        return tensor.nbytes
    return sum(getattr(tensor, part)().nbytes for part in parts)


# A device type registered from Python (PrivateUse1): what devicekit.testing's stand-in
# accelerator is built on. PyTorch calls this API experimental (2.9 and later).


def privateuse1_name() -> str:
    """The device type PrivateUse1 goes by: ``"privateuseone"`` until a backend renames it.

    >>> privateuse1_name() in ("privateuseone", "standin")
    True
    """
    return str(torch._C._get_privateuse1_backend_name())


def privateuse1_number() -> int:
    """PrivateUse1's number in PyTorch's device types, as a ``torch.Stream`` is made with.

    >>> privateuse1_number() > 1  # after the CPU's 0 and CUDA's 1
    True
    """
    kind: Any = torch._C._autograd.DeviceType.PrivateUse1
    return int(kind)


def python_backends() -> bool:
    """Whether this PyTorch can take a backend registered from Python (2.9 and later).

    >>> python_backends() == (torch.__version__ >= "2.9")
    True
    """
    from torch.utils import backend_registration  # noqa: PLC0415 - read where asked

    return hasattr(backend_registration, "_setup_privateuseone_for_python_backend")


def register_python_backend(name: str, module: types.ModuleType) -> None:
    """Rename PrivateUse1 to ``name`` and register ``module`` as its device module, for good."""
    from torch.utils import backend_registration  # noqa: PLC0415 - read where asked

    backend_registration._setup_privateuseone_for_python_backend(name, backend_module=module)


def wrapper_tensor(cls: type[torch.Tensor], like: torch.Tensor, device: torch.device) -> Any:
    """A tensor of ``cls`` shaped as ``like`` on ``device``, holding no memory of its own.

    >>> class Shaped(torch.Tensor):  # a subclass that runs no operation
    ...     __torch_dispatch__ = classmethod(lambda cls, *args, **kwargs: NotImplemented)
    >>> made = wrapper_tensor(Shaped, torch.ones(2, 3), torch.device("meta"))
    >>> made.shape, made.device
    (torch.Size([2, 3]), device(type='meta'))
    """
    return torch.Tensor._make_wrapper_subclass(
        cls,
        like.size(),
        strides=like.stride(),
        storage_offset=like.storage_offset(),
        dtype=like.dtype,
        layout=like.layout,
        device=device,
        requires_grad=like.requires_grad,
    )


def op_leaves(value: Any) -> tuple[list[Any], Any]:
    """An operator's arguments as a flat list, and what rebuilds them (:func:`op_rebuilt`).

    For the arguments of one ATen operator (tuples, lists and dicts of tensors), not user
    data, which devicekit's own flatten reads through its table.

    >>> leaves, spec = op_leaves(((1, [2, 3]), {"alpha": 4}))
    >>> leaves, op_rebuilt([x * 10 for x in leaves], spec)
    ([1, 2, 3, 4], ((10, [20, 30]), {'alpha': 40}))
    """
    from torch.utils import _pytree  # noqa: PLC0415 - loaded by torch already

    return _pytree.tree_flatten(value)


def op_rebuilt(leaves: list[Any], spec: Any) -> Any:
    """The arguments :func:`op_leaves` took apart, with ``leaves`` in their places."""
    from torch.utils import _pytree  # noqa: PLC0415 - loaded by torch already

    return _pytree.tree_unflatten(leaves, spec)


def tensor_text(tensor: torch.Tensor, values: torch.Tensor) -> str:
    """How PyTorch prints ``tensor`` (device, dtype, grad_fn), its values read from ``values``.

    >>> tensor_text(torch.ones(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    'tensor([1, 1], dtype=torch.int32)'
    """
    shown = torch._tensor_str._tensor_str(values, len("tensor("))  # type: ignore[no-untyped-call]
    return str(torch._tensor_str._str(tensor, tensor_contents=shown))  # type: ignore[no-untyped-call]


def not_traced(fn: F) -> F:
    """``fn``, run as it is inside ``torch.compile``: its body is not the program's to trace.

    >>> not_traced(lambda x: x + 1)(1)
    2
    """
    disable: Any = torch._disable_dynamo  # type: ignore[attr-defined]
    return cast("F", disable(fn))


def swap_on_module_conversion(wanted: Callable[[torch.Tensor], bool]) -> None:
    """Make ``Module.to`` swap a parameter into the tensor it moved to where ``wanted`` says.

    It keeps the Parameter object: by setting the new tensor into it where their kinds
    allow, else by swapping the two, which it does for the wrapper tensors it may trace
    (a module-level name of ``torch.nn.modules.module``, read at each conversion).
    """
    modules: Any = torch.nn.modules.module
    traced = modules.is_traceable_wrapper_subclass
    modules.is_traceable_wrapper_subclass = lambda tensor: wanted(tensor) or traced(tensor)


def op_schema(op: Any) -> Any:
    """An ATen operator's schema: its arguments, returns and what each aliases or writes.

    >>> op_schema(torch.ops.aten.add_.Tensor).arguments[0].alias_info.is_write
    True
    """
    return op._schema

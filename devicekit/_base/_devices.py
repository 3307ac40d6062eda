"""Device specifications: what users write, checked against this machine.

Every devicekit function that takes ``device=`` goes through :func:`resolve_device`,
so ``"gpu"``, ``"cuda:7"`` on a one-GPU machine and ``"cuda:-1"`` fail the same way
everywhere, with the valid choices listed, before any data moves.

:func:`link_peak` says what an accelerator's host link can carry, for the parts that judge
a copy's speed (the loader's verdict, ``devicekit bench``) without knowing how devices are
read: the selection part, imported with devicekit, registers the reader
(:func:`register_link_reader`), as it registers the process default.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any, Final, NamedTuple, TypeAlias, cast

import torch

from devicekit._base import _compat
from devicekit._base._errors import DeviceUnavailableError
from devicekit._base._text import shown

__all__ = [
    "HOST_TYPES",
    "DeviceLike",
    "LinkPeak",
    "accelerator_families",
    "accelerator_type",
    "available_devices",
    "forget_accelerator",
    "has_backend",
    "link_peak",
    "mesh_of",
    "new_event",
    "new_stream",
    "no_backend",
    "parse_device",
    "pinned_bytes",
    "register_link_reader",
    "resolve_device",
    "streams_to",
]

DeviceLike: TypeAlias = torch.device | str | int
"""What a ``device=`` argument accepts: a :class:`torch.device`, a string such as
``"cuda:0"``, or the index of a device of this machine's accelerator."""

HOST_TYPES: Final = ("cpu", "meta")
"""The host-side device types: on every machine, without an index, and without a stream.

Work on them runs on the calling thread (``meta`` only computes shapes), so a copy to
them needs no stream to order it and nothing to wait on; every other type is an
accelerator's. Listed in this order by :func:`available_devices`."""

# Accelerator families in the order devicekit prefers them when nothing is asked for; a
# backend registered from Python or by an extension (accelerator_type()) comes after them.
_BUILT_IN = ("cuda", "xpu", "mps")
_EXAMPLES = "'cpu', 'cuda', 'cuda:0', 'mps', 'xpu' or 'meta'"

# Resolutions that cannot change while the process runs: "cpu", "meta", "cuda:1".
# Index-less accelerator specs are left out: they follow the current device.
_resolved: dict[tuple[type, object], torch.device] = {}
_SPECS_KEPT = 1024


@functools.cache
def _device_count(device_type: str) -> int | None:
    """How many devices of a family this machine has; None for families devicekit cannot count."""
    if device_type == "mps":
        return 1 if torch.backends.mps.is_available() else 0
    module = getattr(torch, device_type, None)
    count = getattr(module, "device_count", None)
    if not callable(count):
        return None
    return int(count())


@functools.cache
def accelerator_type() -> str | None:
    """This PyTorch build's accelerator type, such as ``"cuda"``, read without starting it.

    As ``torch.accelerator`` names it (PyTorch 2.6, the oldest devicekit takes, has
    it). None where the build has none.

    >>> accelerator_type() in (None, "cuda", "xpu", "mps")
    True
    """
    found = _compat.current_accelerator()
    return None if found is None else str(found.type)


# Accelerators whose copies can run on a side stream from page-locked host memory: all
# that torch.accelerator offers but MPS (unified memory, no side streams to overlap on).
_WITHOUT_STREAMS = frozenset({"mps"})


def streams_to(device: torch.device) -> bool:
    """Whether copies to ``device`` can overlap on side streams from pinned host memory.

    >>> streams_to(torch.device("cpu")), streams_to(torch.device("meta"))
    (False, False)
    """
    return device.type == accelerator_type() and device.type not in _WITHOUT_STREAMS


def _own(device: torch.device, kind: str) -> Callable[..., Any] | None:
    """A backend's own ``Stream`` or ``Event``, where it is registered from Python.

    Such a backend keeps its streams and events in its module: the ones ``torch.Stream``
    makes for it order nothing (its C++ side has none).
    """
    if device.type != _compat.privateuse1_name():
        return None
    found = getattr(getattr(torch, device.type, None), kind, None)
    return found if callable(found) else None


def new_stream(device: torch.device) -> torch.Stream:
    """A new stream of an accelerator ``device``, for copies that overlap compute."""
    own = _own(device, "Stream")
    return torch.Stream(device=device) if own is None else cast("torch.Stream", own(device))


def new_event(device: torch.device, *, enable_timing: bool = False) -> torch.Event:
    """A new event of an accelerator ``device``, to record on its streams."""
    own = _own(device, "Event")
    if own is None:
        return torch.Event(device=device, enable_timing=enable_timing)
    return cast("torch.Event", own(device, enable_timing=enable_timing))


def pinned_bytes(size: int) -> torch.Tensor:
    """``size`` bytes of page-locked host memory, for copies to the build's accelerator.

    A backend registered from Python has no pinned allocator for ``torch.empty(...,
    pin_memory=True)`` to ask: its memory is pinned by ``pin_memory()``.
    """
    accelerator = accelerator_type()
    if accelerator is not None and _own(torch.device(accelerator), "host_register"):
        return torch.empty(size, dtype=torch.uint8).pin_memory()
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def available_devices() -> list[str]:
    """The devices this machine offers, as strings, for error messages and listings.

    >>> available_devices()[-2:]
    ['cpu', 'meta']
    """
    found = [
        f"{kind}:{index}"
        for kind in accelerator_families()
        for index in range(_device_count(kind) or 0)
    ]
    return [*found, *HOST_TYPES]


def _choices() -> str:
    return ", ".join(repr(name) for name in available_devices())


def mesh_of(tensor: torch.Tensor) -> str | None:
    """Where a DTensor lives: ``[Shard(dim=0)] on a 2-rank cpu mesh``; None for other tensors."""
    mesh = getattr(tensor, "device_mesh", None)
    placements = getattr(tensor, "placements", None)
    if mesh is None or placements is None:
        return None
    ranks = mesh.size()
    return f"[{', '.join(map(repr, placements))}] on a {ranks}-rank {mesh.device_type} mesh"


def has_backend(device_type: str) -> bool:
    """Whether this PyTorch has a backend for ``device_type`` (built in or registered).

    >>> has_backend("cpu"), has_backend("xla")
    (True, False)
    """
    if device_type in HOST_TYPES or device_type == accelerator_type():
        return True
    return getattr(torch, device_type, None) is not None  # an extension's module


def no_backend(spec: str, device_type: str) -> str:
    """The refusal of a device of a type this PyTorch has no backend for; the caller lists.

    >>> no_backend("'xla'", "xla")  # doctest: +ELLIPSIS
    "Expected a device of a backend this PyTorch has, got 'xla': no xla backend is loaded ..."
    """
    return (
        f"Expected a device of a backend this PyTorch has, got {spec}: no {device_type} "
        "backend is loaded (an extension such as torch_xla registers one when imported)."
    )


@functools.cache
def _default_family() -> str:
    """The accelerator family a bare index refers to: the first found, else cpu."""
    return next((kind for kind in accelerator_families() if _device_count(kind)), "cpu")


def accelerator_families() -> tuple[str, ...]:
    """The accelerator families devicekit looks for, in its order: built-in, then the build's own.

    >>> accelerator_families()[:3]
    ('cuda', 'xpu', 'mps')
    """
    other = accelerator_type()
    return _BUILT_IN if other is None or other in _BUILT_IN else (*_BUILT_IN, other)


def forget_accelerator() -> None:
    """Read the accelerator again: a backend was registered while the process ran.

    devicekit reads the build's accelerator once, as fixed; a Python backend (the
    stand-in of :mod:`devicekit.testing`) changes it.
    """
    for cached in (accelerator_type, _device_count, _default_family):
        cached.cache_clear()
    _resolved.clear()
    _links.clear()


def _did_you_mean(spec: str) -> str:
    """A hint where the spec parses once lower-cased and stripped ('CPU', ' cuda:0')."""
    candidate = spec.strip().lower()
    try:
        torch.device(candidate)
    except RuntimeError:
        return ""
    return f" (did you mean {candidate!r}?)"


def parse_device(spec: object) -> torch.device:
    """Parse a device spec without checking that this machine has the device.

    >>> parse_device("cuda:1"), parse_device(torch.device("cpu"))
    (device(type='cuda', index=1), device(type='cpu'))

    Raises:
        DeviceUnavailableError: The spec does not parse, is an index with no accelerator,
            or has an index larger than PyTorch keeps.
        TypeError: The spec is neither a device, a string, nor an index.
    """
    if isinstance(spec, torch.device):
        return spec
    if isinstance(spec, str):
        try:
            device = torch.device(spec)
        except RuntimeError:
            msg = (
                f"Expected a device such as {_EXAMPLES}, got {shown(spec)}{_did_you_mean(spec)}. "
                f"Available here: {_choices()}."
            )
            raise DeviceUnavailableError(msg) from None
        # What torch.device accepted after the colon is digits as written ("cuda:01" is
        # refused): anything else is its index wrapped around.
        written = spec.rpartition(":")[2] if ":" in spec else None
        return _kept(device, spec, written)
    if isinstance(spec, int | numbers.Integral) and type(spec) is not bool:  # numpy's too
        spec = int(spec)
        accelerator = _default_family()
        if accelerator == "cpu":
            msg = (
                f"Expected an accelerator for the device index {shown(spec)}, but this machine "
                f"has none. Available here: {_choices()}."
            )
            raise DeviceUnavailableError(msg)
        if spec < 0:
            msg = (
                f"Expected a device index of 0 or more, got {shown(spec)}. "
                f"Available here: {_choices()}."
            )
            raise DeviceUnavailableError(msg)
        try:
            numbered: torch.device | None = torch.device(accelerator, spec)
        except ValueError:  # past a C++ long long: not an index of any device
            numbered = None
        return _kept(numbered, spec, None if numbered is None else str(spec))
    # bool is an int to Python, and False a 0, but never a device.
    msg = (
        f"Expected a device as a torch.device, a string such as {_EXAMPLES}, or an index, "
        f"got {type(spec).__name__} {shown(spec)}."
    )
    raise TypeError(msg)


def _kept(device: torch.device | None, spec: object, index: str | None) -> torch.device:
    """``device``, made of ``spec``, where it kept the ``index`` written (if any); else refused.

    PyTorch keeps a device's index in 8 bits and wraps a larger one around, silently:
    ``torch.device("cuda:257")`` is ``cuda:1``, a GPU that was not asked for, and
    ``torch.device("cuda", 255)`` is ``cuda``, the current one. None is a device that
    PyTorch could not make of ``spec`` at all.

    >>> _kept(torch.device("cuda", 1), "cuda:257", "257")
    Traceback (most recent call last):
    ...
    devicekit.DeviceUnavailableError: Expected a device index PyTorch can keep, got 'cuda:257', \
which it would read as cuda:1. Available here: ...
    """
    if device is not None and (index is None or str(device.index) == index):
        return device
    would = "cannot hold" if device is None else f"would read as {device}"
    msg = (
        f"Expected a device index PyTorch can keep, got {shown(spec)}, which it {would}. "
        f"Available here: {_choices()}."
    )
    raise DeviceUnavailableError(msg)


def _check_available(device: torch.device, spec: object) -> torch.device:
    if device.type in HOST_TYPES:
        return torch.device(device.type)  # "cpu:0" and "cpu" are one device; tensors say "cpu"
    count = _device_count(device.type)
    if count is None:
        if not has_backend(device.type):
            msg = f"{no_backend(shown(spec), device.type)} Available here: {_choices()}."
            raise DeviceUnavailableError(msg)
        # A family devicekit cannot count (hpu, ...): trust the extension that registered it.
        return device
    if count == 0:
        why = (
            "this PyTorch build has no CUDA support"
            if device.type == "cuda" and torch.version.cuda is None and torch.version.hip is None
            else f"no {device.type} device is visible"
        )
        msg = (
            f"Expected an available device, got {shown(spec)}, but {why}. "
            f"Available here: {_choices()}."
        )
        raise DeviceUnavailableError(msg)
    index = cast("int | None", device.index)  # None for "cuda", whatever the stubs say
    if index is None:
        index = 0 if device.type == "mps" else int(getattr(torch, device.type).current_device())
        return torch.device(device.type, index)
    if index >= count:
        msg = (
            f"Expected a {device.type} index from 0 to {count - 1}, got {shown(spec)}. "
            f"Available here: {_choices()}."
        )
        raise DeviceUnavailableError(msg)
    return device


def resolve_device(spec: DeviceLike) -> torch.device:
    """Turn what a user wrote into a concrete device of this machine.

    Accelerator devices always come back with an index (``"cuda"`` is the current
    CUDA device), so the result compares equal to ``tensor.device``.

    >>> resolve_device("cpu")
    device(type='cpu')
    >>> resolve_device("gpu")
    Traceback (most recent call last):
    ...
    devicekit.DeviceUnavailableError: Expected a device such as 'cpu', ... got 'gpu'. ...

    Args:
        spec: A :class:`torch.device`, a string such as ``"cuda:1"``, or an accelerator
            index.

    Returns:
        The device, with an index for accelerators.

    Raises:
        DeviceUnavailableError: The spec does not parse, or names a device this machine lacks.
        TypeError: The spec is neither a device, a string, nor an index.
    """
    # Keyed by type too: 0, 0.0, False and numpy's 0 hash alike, and only the first
    # names a device.
    try:
        return _resolved[type(spec), spec]
    except (KeyError, TypeError):  # TypeError: an unhashable spec, reported below
        pass
    device = _check_available(parse_device(spec), spec)
    if isinstance(spec, int | str | torch.device) and (
        device.type in HOST_TYPES or parse_device(spec).index is not None
    ):
        if len(_resolved) >= _SPECS_KEPT:
            _resolved.clear()  # distinct specs made at run time must not pile up
        _resolved[type(spec), spec] = device
    return device


class LinkPeak(NamedTuple):
    """An accelerator's host link, and the most it carries host -> device, each direction.

    >>> print(LinkPeak(5, 16, 63.0))
    PCIe gen5 x16, 63 GB/s
    """

    generation: int
    """The PCIe generation: 5 for PCIe 5.0."""
    width: int
    """The lanes: 16 for x16."""
    gb_per_s: float
    """The link's data rate in GB/s (10**9 bytes) after line encoding, one direction.

    Copies reach less: each packet's headers travel too (an H100's pinned ``copy_`` gets
    54.5 of gen5 x16's 63 GB/s, 86%).
    """

    @property
    def name(self) -> str:
        """The link without its rate: ``PCIe gen5 x16``."""
        return f"PCIe gen{self.generation} x{self.width}"

    @property
    def rate(self) -> str:
        """Its rate, to three figures: ``63 GB/s``."""
        return f"{self.gb_per_s:.3g} GB/s"

    def __str__(self) -> str:
        return f"{self.name}, {self.rate}"


def _no_link_reader(device: torch.device) -> LinkPeak | None:
    return None  # until devicekit._select registers one: nothing is known


_link_reader: Callable[[torch.device], LinkPeak | None] = _no_link_reader
# What the reader said of each device: a link does not change while the process runs.
_links: dict[torch.device, LinkPeak | None] = {}


def register_link_reader(read: Callable[[torch.device], LinkPeak | None]) -> None:
    """Read devices' host links with ``read`` (devicekit._select's, through NVML).

    ``read(device)`` returns the link of an accelerator device (``"cuda"`` without an
    index: the current one), or None where it cannot tell; it is asked once per device
    with an index, on first use, and at each call for one without.
    """
    global _link_reader  # noqa: PLW0603 - set once, as devicekit._select is imported
    _link_reader = read
    _links.clear()  # what was answered before spoke for no reader


def link_peak(device: torch.device) -> LinkPeak | None:
    """The host link of ``device`` and its peak; None where unknown (no NVML, not a GPU).

    Read on first use for each device, then kept: the first call for a CUDA device reads
    NVML (every GPU, once, and no CUDA context), the next ones a dict. Host devices have
    no link.

    >>> link_peak(torch.device("cpu")) is None
    True

    Args:
        device: An accelerator device; ``"cuda"`` without an index is the current one.

    Returns:
        The link, or None.
    """
    if device.type in HOST_TYPES:
        return None
    if cast("int | None", device.index) is None:  # the current device, which may change
        return _link_reader(device)
    if device not in _links:
        _links[device] = _link_reader(device)
    return _links[device]

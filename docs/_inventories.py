"""Offline intersphinx inventories for the Python, PyTorch and Hypothesis objects these docs cite.

The docs build on machines without network access, where intersphinx cannot fetch
the real inventories. conf.py writes these small ones first and lists them before
the online ones, so links resolve the same way either way.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

PYTHON = {
    "RuntimeError": ("py:exception", "library/exceptions.html#RuntimeError"),
    "TypeError": ("py:exception", "library/exceptions.html#TypeError"),
    "ValueError": ("py:exception", "library/exceptions.html#ValueError"),
    "RecursionError": ("py:exception", "library/exceptions.html#RecursionError"),
    "OSError": ("py:exception", "library/exceptions.html#OSError"),
    "pickle.UnpicklingError": ("py:exception", "library/pickle.html#pickle.UnpicklingError"),
    "str": ("py:class", "library/stdtypes.html#str"),
    "int": ("py:class", "library/functions.html#int"),
    "bool": ("py:class", "library/functions.html#bool"),
    "bytes": ("py:class", "library/stdtypes.html#bytes"),
    "dict": ("py:class", "library/stdtypes.html#dict"),
    "list": ("py:class", "library/stdtypes.html#list"),
    "tuple": ("py:class", "library/stdtypes.html#tuple"),
    "set": ("py:class", "library/stdtypes.html#set"),
    "type": ("py:class", "library/functions.html#type"),
    "object": ("py:class", "library/functions.html#object"),
    "collections.OrderedDict": ("py:class", "library/collections.html#collections.OrderedDict"),
    "collections.defaultdict": ("py:class", "library/collections.html#collections.defaultdict"),
    "collections.namedtuple": ("py:function", "library/collections.html#collections.namedtuple"),
    "collections.abc.Callable": (
        "py:class",
        "library/collections.abc.html#collections.abc.Callable",
    ),
    "collections.abc.Mapping": ("py:class", "library/collections.abc.html#collections.abc.Mapping"),
    "collections.abc.Collection": (
        "py:class",
        "library/collections.abc.html#collections.abc.Collection",
    ),
    "collections.abc.Hashable": (
        "py:class",
        "library/collections.abc.html#collections.abc.Hashable",
    ),
    "collections.abc.Sequence": (
        "py:class",
        "library/collections.abc.html#collections.abc.Sequence",
    ),
    "collections.abc.Iterator": (
        "py:class",
        "library/collections.abc.html#collections.abc.Iterator",
    ),
    "os.PathLike": ("py:class", "library/os.html#os.PathLike"),
    "collections.abc.Iterable": (
        "py:class",
        "library/collections.abc.html#collections.abc.Iterable",
    ),
    "contextvars.ContextVar": ("py:class", "library/contextvars.html#contextvars.ContextVar"),
    "RuntimeWarning": ("py:exception", "library/exceptions.html#RuntimeWarning"),
    "fork": ("py:function", "library/os.html#os.fork"),
    "dataclasses.replace": ("py:function", "library/dataclasses.html#dataclasses.replace"),
    "typing.Any": ("py:data", "library/typing.html#typing.Any"),
    "typing.Literal": ("py:data", "library/typing.html#typing.Literal"),
    "typing.Protocol": ("py:class", "library/typing.html#typing.Protocol"),
}

TORCH = {
    "torch.Tensor": ("py:class", "tensors.html#torch.Tensor"),
    "torch.Tensor.to": ("py:method", "generated/torch.Tensor.to.html#torch.Tensor.to"),
    "torch.device": ("py:class", "tensor_attributes.html#torch.device"),
    "torch.dtype": ("py:class", "tensor_attributes.html#torch.dtype"),
    "torch.memory_format": ("py:class", "tensor_attributes.html#torch.memory_format"),
    "torch.nn.Module": ("py:class", "generated/torch.nn.Module.html#torch.nn.Module"),
    "torch.nn.modules.module.Module": (
        "py:class",
        "generated/torch.nn.Module.html#torch.nn.Module",
    ),
    "torch.nn.Module.to": ("py:method", "generated/torch.nn.Module.html#torch.nn.Module.to"),
    "torch.optim.Optimizer": ("py:class", "optim.html#torch.optim.Optimizer"),
    "torch.cuda.set_device": (
        "py:function",
        "generated/torch.cuda.set_device.html#torch.cuda.set_device",
    ),
    "torch.utils.data.DistributedSampler": (
        "py:class",
        "data.html#torch.utils.data.distributed.DistributedSampler",
    ),
    "torch.utils.data.DataLoader": (
        "py:class",
        "data.html#torch.utils.data.DataLoader",
    ),
}


HYPOTHESIS = {
    "hypothesis.strategies.SearchStrategy": (
        "py:class",
        "reference/strategies.html#hypothesis.strategies.SearchStrategy",
    ),
    "hypothesis.errors.InvalidArgument": (
        "py:exception",
        "reference/api.html#hypothesis.errors.InvalidArgument",
    ),
}


def write(path: Path, project: str, objects: dict[str, tuple[str, str]]) -> None:
    """Write a Sphinx objects.inv (version 2) listing ``objects``."""
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {project}\n"
        "# Version: \n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    lines = "".join(f"{name} {role} 1 {uri} -\n" for name, (role, uri) in objects.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header.encode() + zlib.compress(lines.encode()))


def write_all(folder: Path) -> dict[str, Path]:
    """Write both inventories into ``folder``; return their paths by name."""
    paths = {name: folder / f"{name}.inv" for name in ("python", "torch", "hypothesis")}
    write(paths["python"], "Python", PYTHON)
    write(paths["torch"], "PyTorch", TORCH)
    write(paths["hypothesis"], "Hypothesis", HYPOTHESIS)
    return paths

"""The mover: how any data is walked and moved to a device.

THE table of per-type decisions (kinds), typed keys (nodes), THE walk (tree), one
to_device call (transfer), how non-tensor leaves move (moves), packed copies, and
what ``Module.to()`` leaves behind (unmoved). It stands on the base alone and knows
nothing of how a device was chosen.
"""

from devicekit._core._kinds import (
    CAST,
    MOVE,
    READ,
    Leaf,
    decide,
    leaf_how,
    register_transfer,
    unregister_transfer,
)
from devicekit._core._nodes import ATTRIBUTE, ITEM, LIST, SET, TUPLE, Key, Node, mapping_items
from devicekit._core._packing import PACK_MAX_BYTES
from devicekit._core._transfer import NonBlocking, in_line_mover, to_device
from devicekit._core._tree import contents, flatten, keys_of, map_flat, map_leaves, paths, walk
from devicekit._core._unmoved import Stray, read_again, strays, tensor_paths

__all__ = [
    "ATTRIBUTE",
    "CAST",
    "ITEM",
    "LIST",
    "MOVE",
    "PACK_MAX_BYTES",
    "READ",
    "SET",
    "TUPLE",
    "Key",
    "Leaf",
    "Node",
    "NonBlocking",
    "Stray",
    "contents",
    "decide",
    "flatten",
    "in_line_mover",
    "keys_of",
    "leaf_how",
    "map_flat",
    "map_leaves",
    "mapping_items",
    "paths",
    "read_again",
    "register_transfer",
    "strays",
    "tensor_paths",
    "to_device",
    "unregister_transfer",
    "walk",
]

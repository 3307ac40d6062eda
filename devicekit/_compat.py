"""The parts of PyTorch that devicekit reads although they are private, in one place.

Each has been in PyTorch since 2.5 at least (devicekit needs 2.6); a release that moves
one breaks this module's tests, not a user's checkpoint.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["weights_only_refusal"]


def weights_only_refusal(pickled: bytes) -> str | None:
    """Why a weights-only load would refuse this pickle of ``torch.save``'s; None if it would not.

    The pickle is read with PyTorch's own scan of what a weights-only load looks up,
    which knows exactly the operations that load knows, and its globals are checked
    against the ones the load allows: PyTorch's, and those added with
    ``torch.serialization.add_safe_globals`` at the time of the call. Nothing is built,
    so the check costs about a fifth of the save of a model's state (a full dry run of
    the load, about twice the save). The refusal is worded as the load words it:
    ``"Unsupported global: GLOBAL module.Name ..."``.
    """
    from torch import _weights_only_unpickler  # noqa: PLC0415 - private: read here

    loader: Any = _weights_only_unpickler  # partly untyped

    try:
        named = loader.get_globals_in_pkl(io.BytesIO(pickled))
    except pickle.UnpicklingError as unknown:  # an operation the load does not know
        return str(unknown)
    allowed = loader._get_allowed_globals().keys() | loader._get_user_allowed_globals().keys()
    refused = sorted(named - allowed)
    if not refused:
        return None
    more = f" (and {', '.join(refused[1:])})" if len(refused) > 1 else ""
    return f"Unsupported global: GLOBAL {refused[0]} was not an allowed global{more}"

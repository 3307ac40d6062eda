"""Property-based testing of data pipelines: Hypothesis strategies and assertions.

Needs Hypothesis: the ``testing`` extra (``python -m pip install -e ".[testing]"`` from
a clone). A collate function, a batch transform or a custom transfer rule can then be
tested against nested batches of the container kinds in :data:`CONTAINER_KINDS`, with
tensors of six dtypes (float32, float64, float16, int64, int32, bool) and of shapes
that include scalars and empty tensors, on every device this machine has::

    import devicekit as dk
    from hypothesis import given
    from devicekit.testing import batches, devices, assert_batches_equal

    @given(batches(), devices())
    def test_round_trip(batch, device):
        assert_batches_equal(dk.to_device(dk.to_device(batch, device), "cpu"), batch)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from devicekit.testing import _containers
from devicekit.testing._assertions import (
    assert_batches_equal,
    assert_on_device,
    assert_same_structure,
)
from devicekit.testing._containers import FrozenRecord, Pair, Record
from devicekit.testing._stand_in import stand_in, still_pinned

if TYPE_CHECKING:
    from devicekit.testing._strategies import batches, devices, tensors

__all__ = [
    "CONTAINER_KINDS",
    "FrozenRecord",
    "Pair",
    "Record",
    "assert_batches_equal",
    "assert_on_device",
    "assert_same_structure",
    "batches",
    "devices",
    "stand_in",
    "still_pinned",
    "tensors",
]

CONTAINER_KINDS = _containers.CONTAINER_KINDS
"""The container kinds :func:`batches` can generate, by the names ``containers=`` takes.

>>> from hypothesis import given
>>> from devicekit.testing import CONTAINER_KINDS, batches
>>> CONTAINER_KINDS[:3]
('dict', 'OrderedDict', 'defaultdict')
>>> @given(batches(containers=("namedtuple", "frozen dataclass")))
... def test_my_collate(batch):
...     ...
>>> test_my_collate()
"""
# Written here, where the API page reads it: an imported name has no docstring of its own.

_STRATEGIES = ("batches", "devices", "tensors")


def __getattr__(name: str) -> Any:
    # The strategies need Hypothesis (the testing extra); the assertions do not, so a
    # project's own tests can use them without it. Imported on first use.
    if name in _STRATEGIES:
        try:
            from devicekit.testing import _strategies  # noqa: PLC0415 - on first use
        except ModuleNotFoundError as err:
            if err.name != "hypothesis":
                raise
            msg = (
                f"devicekit.testing.{name} is a Hypothesis strategy and needs Hypothesis, "
                "which is not installed: install the testing extra "
                '(python -m pip install -e ".[testing]" from a clone). The assertions '
                "(assert_batches_equal, ...) work without it."
            )
            raise ModuleNotFoundError(msg, name="hypothesis") from None
        return getattr(_strategies, name)
    msg = f"module 'devicekit.testing' has no attribute {name!r}"
    raise AttributeError(msg)

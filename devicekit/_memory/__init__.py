"""Device memory: the largest batch that fits, and models built on meta.

``fit_batch`` and its agreement across ranks (ranks), putting back what its tries
changed (restore), and ``materialize``. Loaded on first use.
"""

from devicekit._memory._filler import fill, filler_of
from devicekit._memory._fit_batch import BatchFit, fit_batch
from devicekit._memory._materialize import materialize

__all__ = [
    "BatchFit",
    "fill",
    "filler_of",
    "fit_batch",
    "materialize",
]

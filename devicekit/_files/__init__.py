"""Checkpoints: atomic ``save`` and device-mapped ``load``.

The entry points (checkpoint), the atomic writer, and the weights-only check of what a
file holds. Loaded on first use.
"""

from devicekit._files._checkpoint import load, save

__all__ = ["load", "save"]

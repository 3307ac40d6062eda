"""The ``devicekit`` command line (also ``python -m devicekit``).

For now it reports the version and the device devicekit would use; the ``info``,
``bench`` and ``demo`` commands arrive with the device manager and the docs.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import torch

import devicekit
from devicekit._devices import available_devices, default_device

if TYPE_CHECKING:
    from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Print the devicekit and PyTorch versions and the device devicekit would use.

    >>> main([])  # doctest: +ELLIPSIS
    devicekit ... (PyTorch ...)
    default device: ...
    devices seen: ...
    0

    Args:
        argv: The arguments after the program name; None reads them from the command line.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(
        prog="devicekit", description="Device handling for PyTorch training loops."
    )
    parser.add_argument("--version", action="version", version=devicekit.__version__)
    parser.parse_args(argv)
    print(f"devicekit {devicekit.__version__} (PyTorch {torch.__version__})")
    print(f"default device: {default_device()}")
    print(f"devices seen: {', '.join(available_devices())}")
    return 0

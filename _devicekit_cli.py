"""The ``devicekit`` command's first lines, outside the package on purpose.

Importing devicekit imports PyTorch, which takes a second or two; Ctrl-C then would
print a traceback through PyTorch's imports. Here, before any of that is imported, it
ends the command as Ctrl-C ends it later (:func:`devicekit.cli.main`): one line on
stderr and status 130.
"""

from __future__ import annotations

import sys


def main() -> int:
    """Import the command line, then run it."""
    try:
        from devicekit.cli import main as run  # noqa: PLC0415 - under the guard on purpose
    except KeyboardInterrupt:
        print("\ndevicekit: interrupted.", file=sys.stderr)
        return 130
    return run()


if __name__ == "__main__":
    raise SystemExit(main())

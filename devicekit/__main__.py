"""``python -m devicekit``: the command line."""

import warnings

# PyTorch warns at import when NumPy is missing, which devicekit does not need; this
# process is the command line's own, so the filter reaches no one else's code.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from devicekit.cli import main  # noqa: E402 - after the filter, which must precede torch

raise SystemExit(main())

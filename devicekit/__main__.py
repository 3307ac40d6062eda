"""``python -m devicekit``: the command line."""

from devicekit.cli import main

raise SystemExit(main())

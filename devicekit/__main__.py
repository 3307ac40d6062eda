"""``python -m devicekit``: the command line, as the ``devicekit`` command runs it."""

from _devicekit_cli import main

raise SystemExit(main())

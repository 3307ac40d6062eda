"""``devicekit doctor``: what keeps an accelerator from being used.

The findings over a snapshot of the machine (asking selection how it would choose), and
the report of what was seen.
"""

from devicekit._doctor._findings import diagnose, look
from devicekit._doctor._report import report_json, report_lines

__all__ = [
    "diagnose",
    "look",
    "report_json",
    "report_lines",
]

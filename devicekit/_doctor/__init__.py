"""``devicekit doctor``: what keeps an accelerator from being used.

The findings over a snapshot of the machine (asking selection how it would choose), and
the report of what was seen.
"""

from devicekit._doctor._findings import diagnose, look, refusal
from devicekit._doctor._report import report_lines, report_object

__all__ = [
    "diagnose",
    "look",
    "refusal",
    "report_lines",
    "report_object",
]

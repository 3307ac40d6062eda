"""The command line's programs: ``devicekit demo`` and ``devicekit bench``.

Loaded by the command only.
"""

from devicekit._commands._bench import bench_report, measure_bench
from devicekit._commands._demo import BATCH_SIZE, fit_demo_batch, schedule_for, train

__all__ = [
    "BATCH_SIZE",
    "bench_report",
    "fit_demo_batch",
    "measure_bench",
    "schedule_for",
    "train",
]

"""DeviceDataLoader: batches that arrive on the device.

The pipeline's seam, pinning and copies ahead (pipeline), the feed thread that reads
ahead (feed), and each epoch's figures (recorder, stats).
"""

from devicekit._loader._loader import DeviceDataLoader
from devicekit._loader._stats import LoaderStats

__all__ = [
    "DeviceDataLoader",
    "LoaderStats",
]

"""The stand-in accelerator: a CPU-backed device that PyTorch and devicekit treat as a GPU.

Rooms: ``_start`` (``stand_in()``: registration, once per process), ``_tensor`` (the
tensors and CUDA's rule on mixing devices), ``_streams`` (streams, events and the latest
moment work may run), ``_memory`` (capacity, figures, the ledger of pinned memory),
``_module`` (``torch.<name>``), ``_saving`` (``torch.save``/``torch.load``), ``_device``
(what was started, each thread's current device).
"""

from devicekit.testing._stand_in._memory import still_pinned
from devicekit.testing._stand_in._start import NAME, stand_in

__all__ = ["NAME", "stand_in", "still_pinned"]

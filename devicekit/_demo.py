"""The demo: a small CNN trained on synthetic images through devicekit, end to end.

Synthetic, so it needs no download: each of 10 classes is a fixed random 3x16x16
pattern, and every image is its class's pattern under noise. A CNN learns that in a
few epochs, so the loss visibly falls on any device.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from devicekit._checks import guard
from devicekit._loader import DeviceDataLoader
from devicekit._memory import BatchFit, fit_batch
from devicekit._transfer import to_device

__all__ = ["FIT_LIMIT", "EpochReport", "SmallCNN", "fit_demo_batch", "synthetic_images", "train"]

CLASSES = 10
IMAGE_SIZE = 16
FIT_LIMIT = 1024
"""The largest batch ``--fit-batch`` tries: the small CNN fits far more on any GPU."""
SLOW_DATA_S = 0.030
"""What ``--slow-data`` adds to making each batch: more than a step takes on most machines."""


class SmallCNN(nn.Module):
    """Two convolutions, pooling and a linear classifier: seconds per epoch on a CPU."""

    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(32, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class scores for a batch of images."""
        scores: torch.Tensor = self.classifier(self.features(images).flatten(1))
        return scores


def synthetic_images(count: int, *, seed: int = 0) -> TensorDataset:
    """``count`` noisy images of 10 fixed patterns, with their class labels."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(CLASSES, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    labels = torch.randint(0, CLASSES, (count,), generator=generator)
    noise = torch.randn(count, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return TensorDataset(2 * patterns[labels] + noise, labels)


@dataclasses.dataclass(frozen=True)
class EpochReport:
    """One epoch of the demo."""

    epoch: int
    loss: float
    """The epoch's mean loss."""
    first_loss: float
    """The loss of its first batch: where the epoch started from."""
    samples: int
    samples_per_second: float
    seconds: float
    wait_fraction: float
    """The share of the epoch the loop waited for data (:attr:`DeviceDataLoader.stats`)."""
    verdict: str
    """Whether the epoch was input- or compute-bound, and what to change."""


def _slowly(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """PyTorch's collation after a pause: a dataset whose samples are slow to make."""
    time.sleep(SLOW_DATA_S)
    collated: list[torch.Tensor] = default_collate(batch)
    return collated


def fit_demo_batch(device: torch.device) -> BatchFit:
    """The largest batch of the demo's training step that fits on ``device``.

    Up to :data:`FIT_LIMIT`. Each try is one real step (forward, backward, the
    optimizer's step) on synthetic images, as :func:`~devicekit.fit_batch` asks, with the
    model and optimizer made as :func:`train` makes them; ``restore=`` puts both back as
    they were once the search ends, as a loop that goes on to train them needs.
    """
    torch.manual_seed(0)
    limit = FIT_LIMIT
    images = synthetic_images(limit)
    model, optimizer = _model_and_optimizer(device)

    def step(batch_size: int) -> None:
        optimizer.zero_grad(set_to_none=True)  # a failed try's gradients go with it
        batch = to_device(images[:batch_size], device)
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()  # type: ignore[no-untyped-call]  # untyped in PyTorch's stubs
        optimizer.step()

    return fit_batch(step, start=64, limit=limit, device=device, restore=(model, optimizer))


def _model_and_optimizer(device: torch.device) -> tuple[SmallCNN, torch.optim.Adam]:
    model = to_device(SmallCNN(), device)
    return model, torch.optim.Adam(model.parameters(), lr=3e-3)


def train(
    device: torch.device,
    *,
    epochs: int,
    samples: int = 4096,
    batch_size: int = 64,
    slow_data: bool = False,
    on_batch: Callable[[int, int, int], None] | None = None,
) -> Iterator[EpochReport]:
    """Train :class:`SmallCNN` on :func:`synthetic_images` on ``device``.

    The loop is the one a user writes: a DataLoader wrapped in DeviceDataLoader, the
    model moved with to_device and guarded, so a device mistake would be named.

    Args:
        device: Where to train.
        epochs: How many passes over the data.
        samples: How many images.
        batch_size: Images per batch.
        slow_data: Make every batch take :data:`SLOW_DATA_S` longer to load, so that the
            loop waits for its data and the loader's verdict says so.
        on_batch: Called as ``on_batch(epoch, batches_done, batches)``, for progress.

    Yields:
        A report as each epoch ends.
    """
    torch.manual_seed(0)
    collate = _slowly if slow_data else None
    images = DataLoader(
        synthetic_images(samples), batch_size=batch_size, shuffle=True, collate_fn=collate
    )
    loader = DeviceDataLoader(images, device)
    model, optimizer = _model_and_optimizer(device)
    with guard(model):
        for epoch in range(1, epochs + 1):
            start = time.perf_counter()
            total, seen = torch.zeros((), device=device), 0
            first = torch.zeros((), device=device)
            for index, (images, labels) in enumerate(loader):
                loss = nn.functional.cross_entropy(model(images), labels)
                optimizer.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]  # untyped in PyTorch's stubs
                optimizer.step()
                if index == 0:
                    first = loss.detach()
                total += loss.detach() * len(labels)  # summed on the device: no sync per step
                seen += len(labels)
                if on_batch is not None:
                    on_batch(epoch, index + 1, len(loader))
            mean, first_loss = (total / seen).item(), first.item()  # a sync per epoch
            seconds = time.perf_counter() - start
            stats = loader.stats
            yield EpochReport(
                epoch,
                mean,
                first_loss,
                seen,
                seen / seconds,
                seconds,
                stats.wait_fraction,
                stats.verdict,
            )

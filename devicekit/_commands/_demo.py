"""The demo: a small CNN trained on synthetic images through devicekit, end to end.

Synthetic, so it needs no download: each of 10 classes is a fixed random 3x16x16
pattern, and every image is its class's pattern under noise. A CNN learns that in a
few epochs, so the loss visibly falls on any device.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from devicekit._base import count
from devicekit._checks import guard
from devicekit._core import to_device
from devicekit._loader import DeviceDataLoader
from devicekit._memory import BatchFit, fit_batch

__all__ = [
    "FIT_LIMIT",
    "EpochReport",
    "Schedule",
    "SmallCNN",
    "fit_demo_batch",
    "schedule_for",
    "synthetic_images",
    "train",
]

CLASSES = 10
IMAGE_SIZE = 16
FIT_LIMIT = 1024
"""The largest batch ``--fit-batch`` tries: the small CNN fits far more on any GPU."""
SLOW_DATA_S = 0.030
"""What ``--slow-data`` adds to making each batch: more than a step takes on an idle machine,
so the run is input-bound there; on a loaded one, where a step takes longer, it may not be."""
_sleep = time.sleep  # how --slow-data pauses: a test's fake clock replaces it
BATCH_SIZE = 64
"""The demo's batch without ``--fit-batch``: the one its learning rate is tuned for."""
LEARNING_RATE = 3e-3
"""Adam's learning rate at :data:`BATCH_SIZE`."""
SAMPLES = 4096
"""Images per epoch at :data:`BATCH_SIZE`: 64 steps."""
WARMUP_STEPS = 4
"""Steps over which a learning rate scaled up is reached, from a quarter of it."""


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
    _sleep(SLOW_DATA_S)
    collated: list[torch.Tensor] = default_collate(batch)
    return collated


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How the demo trains at a batch size: learning rate, warm-up and images per epoch."""

    batch_size: int
    learning_rate: float
    warmup_steps: int
    """Steps over which the learning rate rises linearly to :attr:`learning_rate`."""
    samples: int
    """Images per epoch: a whole number of batches."""

    def explain(self) -> str:
        """One line: the learning rate for this batch and the rule that gave it."""
        warmup = f", warm-up {count(self.warmup_steps, 'step')}" if self.warmup_steps else ""
        steps = count(self.samples // self.batch_size, "step")
        return (
            f"Learning rate {LEARNING_RATE:g} -> {self.learning_rate:.3g} for batch "
            f"{self.batch_size} (square-root scaling from batch {BATCH_SIZE}, as for "
            f"Adam{warmup}); each epoch {self.samples:,} images in {steps}."
        )


def schedule_for(batch_size: int, *, steps: int | None = None) -> Schedule:
    """How the demo trains at ``batch_size``, so that its loss falls as at batch 64.

    Adam's square-root scaling rule: the learning rate is :data:`LEARNING_RATE` times
    ``sqrt(batch_size / 64)``, reached over :data:`WARMUP_STEPS` steps where it is
    scaled up. An epoch has ``64 / sqrt(batch_size / 64)`` steps (64 at batch 64, 16 at
    1024), so that the learning rate times the steps of an epoch stays as at batch 64.

    >>> schedule_for(1024)
    Schedule(batch_size=1024, learning_rate=0.012, warmup_steps=4, samples=16384)
    >>> schedule_for(64) == Schedule(64, LEARNING_RATE, 0, SAMPLES)
    True
    >>> print(schedule_for(1024).explain())  # doctest: +NORMALIZE_WHITESPACE
    Learning rate 0.003 -> 0.012 for batch 1024 (square-root scaling from batch 64, as
    for Adam, warm-up 4 steps); each epoch 16,384 images in 16 steps.
    >>> schedule_for(64, steps=2).samples  # ``--steps 2``: a short run
    128

    Args:
        batch_size: The batch to train at, such as :func:`fit_demo_batch` found.
        steps: Steps per epoch in place of the rule's (``--steps``); None for the rule's.

    Returns:
        The learning rate, warm-up and images per epoch at that batch.
    """
    # The linear rule (Goyal et al., 2017) is SGD's: SGD's step grows with the gradient
    # and its noise falls as 1/batch. Adam divides the gradient by its own running
    # scale, so its step is about the learning rate whatever the batch, and the rule
    # that keeps its training the same is the square root (Malladi et al., 2022). The
    # warm-up tames Adam's first steps, its largest (their running scale is one
    # gradient). Measured on the CPU at batch 1024 over 3 epochs (batch 64: last epoch's
    # loss 0.117): this rule 0.093, without its warm-up 0.23; the linear rule's 0.048
    # 1.74, and 0.13 with the warm-up (but 0.53 where the seed is 2, against 0.19).
    scale = math.sqrt(batch_size / BATCH_SIZE)
    # An epoch of 4096 images is only 4 steps of 1024, and no learning rate makes up
    # for that (2.314 -> 2.06 after 3 epochs, the best rate tried): the loss needs some 40 steps.
    # Adam moves each weight about the learning rate per step, so keeping the learning
    # rate times the steps of an epoch as at batch 64 gives the larger batch as far to
    # go per epoch, in fewer, less noisy steps: at 1024, 16 steps, 4 times the images
    # of batch 64 per epoch. A larger batch is faster per image on a GPU, not more
    # useful per image.
    if steps is None:
        steps = max(1, round(SAMPLES // BATCH_SIZE / scale))
    return Schedule(
        batch_size,
        LEARNING_RATE * scale,
        WARMUP_STEPS if batch_size > BATCH_SIZE else 0,
        steps * batch_size,
    )


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


def _model_and_optimizer(
    device: torch.device, learning_rate: float = LEARNING_RATE
) -> tuple[SmallCNN, torch.optim.Adam]:
    model = to_device(SmallCNN(), device)
    return model, torch.optim.Adam(model.parameters(), lr=learning_rate)


def train(
    device: torch.device,
    *,
    epochs: int,
    samples: int = SAMPLES,
    batch_size: int = BATCH_SIZE,
    learning_rate: float = LEARNING_RATE,
    warmup_steps: int = 0,
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
        learning_rate: Adam's learning rate (:func:`schedule_for` scales it to a batch).
        warmup_steps: Steps over which the learning rate rises linearly to
            ``learning_rate``, from ``learning_rate / warmup_steps``; 0 for none.
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
    model, optimizer = _model_and_optimizer(device, learning_rate)
    # PyTorch's own scheduler, as a user would write it: the factor of step n is (n+1)/w.
    warmup = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps))
    )
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
                warmup.step()
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

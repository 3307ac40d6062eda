"""The tutorial's classifier, tested on devicekit's stand-in accelerator: no GPU needed.

Run ``python -m pytest examples/test_classifier.py``. The ``stand_in_device`` fixture
(devicekit's pytest plugin) starts the stand-in, a CPU-backed device that PyTorch treats
as a GPU, and gives ``standin:0``. The loop runs there as on a GPU, with CUDA's errors
and its asynchrony at its worst, and computes what it computes on the CPU, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import devicekit as dk


class Net(nn.Module):
    """The tutorial's classifier: one convolution, pooled, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Three scores per image."""
        return self.head(self.features(x))


def dataset() -> TensorDataset:
    images = torch.randn(256, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    labels = images.mean(dim=(2, 3)).argmax(dim=1)  # 3 classes: the brightest channel
    return TensorDataset(images, labels)


def train(device: torch.device | str, *, move_batches: bool = True) -> list[float]:
    """The tutorial's plain PyTorch loop: every epoch's last loss."""
    torch.manual_seed(0)
    model = Net().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = DataLoader(dataset(), batch_size=64, shuffle=True, pin_memory=True)
    losses = []
    for _ in range(2):
        for images, labels in loader:
            x, y = images, labels
            if move_batches:
                x, y = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    return losses


def train_with_devicekit(device: torch.device | str) -> list[float]:
    """The tutorial's last loop: DeviceDataLoader brings each batch to the device."""
    torch.manual_seed(0)
    model = dk.to_device(Net(), device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = dk.DeviceDataLoader(DataLoader(dataset(), batch_size=64, shuffle=True), device)
    losses = []
    for _ in range(2):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    loader.close()
    return losses


def test_the_loop_computes_on_the_stand_in_what_it_computes_on_the_cpu(
    stand_in_device: torch.device,
) -> None:
    assert train(stand_in_device) == train("cpu")
    assert train_with_devicekit(stand_in_device) == train_with_devicekit("cpu")


def test_a_forgotten_to_fails_as_on_a_gpu(stand_in_device: torch.device) -> None:
    with pytest.raises(RuntimeError, match="found at least two devices, cpu and standin:0"):
        train(stand_in_device, move_batches=False)


def test_a_result_read_before_its_copy_ends_is_nan(stand_in_device: torch.device) -> None:
    scores = torch.ones(4, device=stand_in_device)
    early = scores.to("cpu", non_blocking=True)  # lands once the stream is waited for
    assert early.isnan().all()  # read too soon: on a GPU, whatever the memory held
    torch.accelerator.synchronize(stand_in_device)
    assert early.tolist() == [1.0, 1.0, 1.0, 1.0]

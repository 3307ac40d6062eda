"""A small CNN on image batches (random images, two classes: brighter or darker than average).

Run ``python examples/cnn.py`` (``--epochs``, ``--device``). Batches arrive on the device
through DeviceDataLoader; guard names any input left on another device.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import devicekit as dk


def make_images(count: int) -> TensorDataset:
    images = torch.rand(count, 1, 28, 28) + torch.randn(count, 1, 1, 1) * 0.2
    labels = (images.mean(dim=(1, 2, 3)) > images.mean()).long()
    return TensorDataset(images, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--device", help="a device such as cuda:1 (default: devicekit's choice)")
    args = parser.parse_args()

    torch.manual_seed(0)
    manager = dk.DeviceManager(args.device) if args.device else dk.DeviceManager()
    model = nn.Sequential(
        nn.Conv2d(1, 8, kernel_size=3, stride=2),
        nn.ReLU(),
        nn.Conv2d(8, 16, kernel_size=3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.LazyLinear(2),
    )
    model(torch.zeros(1, 1, 28, 28))  # sizes the lazy layer before the move
    model = dk.to_device(model, manager.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = dk.DeviceDataLoader(
        DataLoader(make_images(2048), batch_size=128, shuffle=True), manager.device
    )
    with dk.guard(model):
        for epoch in range(args.epochs):
            correct = torch.zeros((), device=manager.device)
            for images, labels in loader:
                scores = model(images)
                loss = nn.functional.cross_entropy(scores, labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                correct += (scores.argmax(dim=1) == labels).sum()
            accuracy = correct.item() / len(loader.dataset)
            print(f"epoch {epoch}: loss {loss.item():.6f}, accuracy {accuracy:.1%}")


if __name__ == "__main__":
    main()

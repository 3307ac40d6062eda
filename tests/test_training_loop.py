"""The loop every PyTorch tutorial starts with needs only the wrapper to train on the device."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import devicekit as dk


def test_a_linear_regression_trains_through_the_wrapper() -> None:
    torch.manual_seed(0)
    inputs = torch.randn(256, 3)
    targets = inputs @ torch.tensor([[2.0], [-1.0], [0.5]]) + 0.3
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=True)

    # On a GPU machine DeviceManager() picks the GPU; prefer=("cpu",) keeps CI deterministic.
    with dk.DeviceManager(prefer=("cpu",)) as manager:
        model = dk.to_device(nn.Linear(3, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = dk.DeviceDataLoader(loader)
        losses = []
        for _epoch in range(20):
            for features, target in batches:
                assert features.device == manager.device
                loss = nn.functional.mse_loss(model(features), target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0] / 100
    assert losses[-1] < 1e-3

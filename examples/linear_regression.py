"""Linear regression with a TensorDataset and a DataLoader, trained on the selected device.

Run ``python examples/linear_regression.py`` (``--epochs``, ``--device``).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import devicekit as dk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--device", help="a device such as cuda:1 (default: devicekit's choice)")
    args = parser.parse_args()

    torch.manual_seed(0)
    true_weight, true_bias = torch.tensor([[2.0], [-3.0]]), 0.5
    inputs = torch.randn(1024, 2)
    targets = inputs @ true_weight + true_bias + 0.01 * torch.randn(1024, 1)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=64, shuffle=True)

    with dk.DeviceManager(args.device) if args.device else dk.DeviceManager() as manager:
        print(f"training on {manager.device}: {manager.reason}")
        model = dk.to_device(nn.Linear(2, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        device_loader = dk.DeviceDataLoader(loader)  # wrapped once, iterated every epoch
        for epoch in range(args.epochs):
            for features, target in device_loader:  # batches arrive on the device
                loss = nn.functional.mse_loss(model(features), target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            if epoch % 10 == 0 or epoch == args.epochs - 1:
                print(f"epoch {epoch}: loss {loss.item():.5f}")
    weight = model.weight.detach().cpu().flatten().tolist()
    print(f"learned weight {weight[0]:.2f}, {weight[1]:.2f} and bias {model.bias.item():.2f}")


if __name__ == "__main__":
    main()

"""Move a tensor and a linear model to the accelerator and back: the first steps, with devicekit.

Run ``python examples/tensors_and_models.py`` (``--device cpu`` to choose).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import devicekit as dk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="a device such as cuda:1 (default: devicekit's choice)")
    args = parser.parse_args()

    # Instead of torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    manager = dk.DeviceManager(args.device) if args.device else dk.DeviceManager()
    print(manager.explain())
    device = manager.device

    x = torch.arange(6.0).reshape(2, 3)
    x_on_device = dk.to_device(x, device)
    print(f"x is on {x.device}; its copy is on {x_on_device.device}")

    model = dk.to_device(nn.Linear(3, 2), device)  # moves in place, like model.to()
    y = model(x_on_device)
    print(f"the model's output is on {y.device}")

    back = dk.to_device({"input": x_on_device, "output": y.detach()}, "cpu")
    print(f"back on the host: {back['output'].tolist()}")


if __name__ == "__main__":
    main()

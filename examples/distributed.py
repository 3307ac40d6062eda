"""Data-parallel training under torchrun: each rank on its own device, its own shard.

Run ``torchrun --nproc_per_node=4 examples/distributed.py`` (``--epochs``). On GPUs each
rank trains on ``cuda:LOCAL_RANK`` with NCCL; without them, on the CPU with gloo. Run with
plain ``python``, it is one process: a group of one, which is how a script written for
torchrun is tried out on a laptop.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import devicekit as dk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    # cuda:LOCAL_RANK under torchrun, made the process's current device: "cuda" means it
    manager = dk.DeviceManager.from_env()
    backend = "nccl" if manager.device.type == "cuda" else "gloo"
    # device_id binds the group to the rank's GPU; None on the CPU, which PyTorch refuses.
    if "RANK" in os.environ:  # torchrun's rendezvous, from the variables it sets
        dist.init_process_group(backend, device_id=manager.device_id)
    else:  # plain python: a group of one, kept in this process
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, device_id=manager.device_id
        )
    rank = dist.get_rank()
    # flush: each rank's output is a pipe under torchrun, written in blocks otherwise
    print(f"rank {rank}: {manager.device} ({manager.reason})", flush=True)

    torch.manual_seed(0)  # the same data and initial weights on every rank
    inputs = torch.randn(512, 4)
    dataset = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    sampler = DistributedSampler(dataset)  # each rank gets its own shard
    loader = dk.DeviceDataLoader(DataLoader(dataset, batch_size=32, sampler=sampler))

    with manager:
        model = DistributedDataParallel(dk.to_device(nn.Linear(4, 1)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)  # reshuffles the shards, through the wrapper
            for features, target in loader:
                loss = nn.functional.mse_loss(model(features), target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            if rank == 0:
                print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)
    # Every rank's last gradient reductions end before the group does, and the model's
    # reducer goes while the group still stands: gloo's worker thread is then idle when
    # the group is torn down (PyTorch can deadlock at exit when it is not).
    dist.barrier()
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

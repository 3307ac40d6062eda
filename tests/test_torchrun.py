"""A real torchrun launch: every rank's DeviceManager.from_env() follows its LOCAL_RANK."""

from __future__ import annotations

import json
import os
import textwrap
from typing import TYPE_CHECKING, Any

import torch

from .programs import run_program

if TYPE_CHECKING:
    from pathlib import Path

# The scripts start no process group: what they check (each rank's LOCAL_RANK, the
# sampler's shards) needs none, and PyTorch 2.6's gloo can deadlock tearing one down
# (its worker thread waits for the GIL that destroy_process_group holds). Each rank
# writes what it saw to a file of its own in the folder given as its argument.
RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch
    import devicekit as dk

    class TwoGpus:  # stands in for a node with two GPUs, on machines without them
        name = device_type = "cuda"
        def devices(self):
            return [dk.DeviceInfo(torch.device("cuda", i), "cuda", i) for i in range(2)]

    warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback, on CPU machines
    manager = dk.DeviceManager.from_env()
    stand_in = dk.DeviceManager.from_env(backends=[TwoGpus()])
    mine = {
        "rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "device": str(manager.device),
        "reason": manager.reason,
        "stand_in": [str(stand_in.device), stand_in.reason],
    }
    with open(os.path.join(sys.argv[1], f"rank{mine['rank']}.json"), "w") as out:
        json.dump(mine, out)
    """
)


SAMPLER_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    import devicekit as dk

    warnings.simplefilter("ignore", RuntimeWarning)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dataset = TensorDataset(torch.arange(40))
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=3)
    loader = dk.DeviceDataLoader(DataLoader(dataset, batch_size=4, sampler=sampler))
    seen = {}
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen[epoch] = [int(i) for (batch,) in loader for i in batch.cpu()]
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
        json.dump(seen, out)
    """
)


DDP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    import devicekit as dk

    warnings.simplefilter("ignore", RuntimeWarning)
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = TensorDataset(torch.arange(40.0).unsqueeze(1))
    seen = {}
    for calls in ("none", "loader", "sampler"):  # who tells the sampler the epoch
        sampler = DistributedSampler(dataset, shuffle=True, seed=3)
        loader = dk.DeviceDataLoader(DataLoader(dataset, batch_size=4, sampler=sampler))
        seen[calls] = []
        for epoch in range(2):
            if calls == "loader":
                loader.set_epoch(epoch)
            elif calls == "sampler":
                sampler.set_epoch(epoch)
            order = []
            for (batch,) in loader:
                loss = model(batch).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                order += [int(value) for value in batch.cpu().flatten()]
            seen[calls].append(order)
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as out:
        json.dump(seen, out)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _torchrun(python: str, tmp_path: Path, script: str, **environ: str) -> list[Any]:
    """What each of two ranks wrote, in rank order; ``environ`` added to the launch's."""
    path = tmp_path / "script.py"
    path.write_text(script)
    launch = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, **environ}
    result = run_program([*launch, str(path), str(tmp_path)], timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_set_epoch_through_the_loader_reshuffles_disjoint_shards(
    tmp_path: Path, fresh_python: str
) -> None:
    ranks = _torchrun(fresh_python, tmp_path, SAMPLER_SCRIPT)
    for epoch in ("0", "1"):
        shards = [set(rank[epoch]) for rank in ranks]
        assert not shards[0] & shards[1]
        assert shards[0] | shards[1] == set(range(40))
    assert any(rank["0"] != rank["1"] for rank in ranks)  # set_epoch reshuffled


def test_a_ddp_loop_sees_a_new_order_each_epoch_whoever_sets_the_epoch(
    tmp_path: Path, fresh_python: str
) -> None:
    ranks = _torchrun(fresh_python, tmp_path, DDP_SCRIPT)
    for calls in ("none", "loader", "sampler"):
        for epoch in (0, 1):
            shards = [set(rank[calls][epoch]) for rank in ranks]
            assert not shards[0] & shards[1], calls  # each rank its own samples
            assert shards[0] | shards[1] == set(range(40)), calls
        for rank in ranks:
            assert rank[calls][0] != rank[calls][1], calls  # the second epoch reshuffled
        assert ranks[0][calls] == ranks[0]["none"]  # the epoch numbers agree: 0, then 1


def test_each_rank_gets_the_device_of_its_local_rank(tmp_path: Path, fresh_python: str) -> None:
    # Launched as inside a Slurm job: every rank inherits the batch step's SLURM_LOCALID=0,
    # and torchrun, the innermost launcher, is the one followed.
    ranks = _torchrun(
        fresh_python, tmp_path, RANK_SCRIPT, SLURM_LOCALID="0", SLURM_NTASKS_PER_NODE="1"
    )
    assert [(entry["rank"], entry["local_rank"]) for entry in ranks] == [(0, 0), (1, 1)]
    assert [entry["stand_in"] for entry in ranks] == [
        ["cuda:0", "LOCAL_RANK=0 (torchrun inside Slurm) selects it"],
        ["cuda:1", "LOCAL_RANK=1 (torchrun inside Slurm) selects it"],
    ]
    gpus = torch.cuda.device_count()
    for entry in ranks:
        assert f"LOCAL_RANK={entry['local_rank']}" in entry["reason"]
        if gpus >= 2:
            assert entry["device"] == f"cuda:{entry['local_rank']}"
        elif gpus == 0:
            assert entry["device"] == "cpu"

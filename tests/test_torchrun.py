"""A real torchrun launch: every rank's DeviceManager.from_env() follows its LOCAL_RANK."""

from __future__ import annotations

import json
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import torch

from .programs import run_program

if TYPE_CHECKING:
    from pathlib import Path

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, warnings
    import torch
    import torch.distributed as dist
    import devicekit as dk

    warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback, on CPU machines
    dist.init_process_group("gloo")
    manager = dk.DeviceManager.from_env()
    mine = {
        "rank": dist.get_rank(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "device": str(manager.device),
        "reason": manager.reason,
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    """
)


SAMPLER_SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    import devicekit as dk

    warnings.simplefilter("ignore", RuntimeWarning)
    dist.init_process_group("gloo")
    dataset = TensorDataset(torch.arange(40))
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = dk.DeviceDataLoader(DataLoader(dataset, batch_size=4, sampler=sampler))
    seen = {}
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen[epoch] = [int(i) for (batch,) in loader for i in batch.cpu()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    """
)


def _torchrun(tmp_path: Path, script: str) -> list[Any]:
    path = tmp_path / "script.py"
    path.write_text(script)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = run_program([*launch, str(path)], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    everyone: list[Any] = json.loads(line.removeprefix("RESULT "))
    return everyone


def test_set_epoch_through_the_loader_reshuffles_disjoint_shards(tmp_path: Path) -> None:
    ranks = _torchrun(tmp_path, SAMPLER_SCRIPT)
    for epoch in ("0", "1"):
        shards = [set(rank[epoch]) for rank in ranks]
        assert not shards[0] & shards[1]
        assert shards[0] | shards[1] == set(range(40))
    assert any(rank["0"] != rank["1"] for rank in ranks)  # set_epoch reshuffled


def test_each_rank_gets_the_device_of_its_local_rank(tmp_path: Path) -> None:
    ranks = sorted(_torchrun(tmp_path, RANK_SCRIPT), key=lambda entry: entry["rank"])
    assert [entry["local_rank"] for entry in ranks] == [0, 1]
    gpus = torch.cuda.device_count()
    for entry in ranks:
        assert f"LOCAL_RANK={entry['local_rank']}" in entry["reason"]
        if gpus >= 2:
            assert entry["device"] == f"cuda:{entry['local_rank']}"
        elif gpus == 0:
            assert entry["device"] == "cpu"

"""A real torchrun launch: every rank's DeviceManager.from_env() follows its LOCAL_RANK."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

import torch

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
    dist.destroy_process_group()
    """
)


def test_each_rank_gets_the_device_of_its_local_rank(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = subprocess.run(
        [*launch, str(script)], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    ranks = sorted(json.loads(line.removeprefix("RESULT ")), key=lambda entry: entry["rank"])
    assert [entry["local_rank"] for entry in ranks] == [0, 1]
    gpus = torch.cuda.device_count()
    for entry in ranks:
        assert f"LOCAL_RANK={entry['local_rank']}" in entry["reason"]
        if gpus >= 2:
            assert entry["device"] == f"cuda:{entry['local_rank']}"
        elif gpus == 0:
            assert entry["device"] == "cpu"

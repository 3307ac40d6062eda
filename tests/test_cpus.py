"""The CPUs a process may use: its affinity within its cgroup's quota, v1 and v2, as a table."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devicekit._loader import _cpus

# Each case: the cgroup files (path under the cgroup root -> text), /proc/self/cgroup's
# text, and the CPUs the quota allows (None: no quota set).
CASES = {
    "v2, 2 CPUs": ({"cpu.max": "200000 100000"}, "0::/", 2.0),
    "v2, unlimited": ({"cpu.max": "max 100000"}, "0::/", None),
    "v2, the parent's tighter": (
        {"job/cpu.max": "max 100000", "cpu.max": "150000 100000"},
        "0::/job",
        1.5,
    ),
    "v2, the child's tighter": (
        {"job/cpu.max": "50000 100000", "cpu.max": "400000 100000"},
        "0::/job",
        0.5,
    ),
    "v2, a host path a container does not see": (
        {"cpu.max": "300000 100000"},
        "0::/kubepods/pod1/abc",
        3.0,
    ),
    "v1, cpu,cpuacct": (
        {"cpu,cpuacct/cpu.cfs_quota_us": "300000", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
        "4:memory:/x\n2:cpu,cpuacct:/\n",
        3.0,
    ),
    "v1, unlimited (-1)": (
        {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},
        "1:cpu:/",
        None,
    ),
    "v1, cpu mounted alone, a nested group": (
        {"cpu/job/cpu.cfs_quota_us": "250000", "cpu/job/cpu.cfs_period_us": "100000"},
        "3:cpuacct,cpu:/job",
        2.5,
    ),
    "no cgroup files": ({}, "0::/", None),
    "unreadable values": ({"cpu.max": "lots of them"}, "0::/\nnot a cgroup line", None),
    "no membership file": ({"cpu.max": "200000 100000"}, None, None),
}


def _cgroup(root: Path, files: dict[str, str]) -> None:
    root.mkdir()
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")


@pytest.mark.parametrize(("files", "membership", "quota"), CASES.values(), ids=CASES.keys())
def test_the_quota_is_read_from_cgroup_v1_and_v2(
    tmp_path: Path, files: dict[str, str], membership: str | None, quota: float | None
) -> None:
    _cgroup(tmp_path / "cgroup", files)
    assert _cpus.cgroup_quota(str(tmp_path / "cgroup"), membership) == quota


@pytest.mark.parametrize(
    ("affinity", "cpu_max", "expected"),
    [
        (8, "200000 100000", 2),  # the quota is tighter than the cores allowed
        (2, "800000 100000", 2),  # the affinity is
        (8, "150000 100000", 1),  # 1.5 CPUs: rounded down
        (8, "20000 100000", 1),  # a fifth of one: never below 1
        (6, "max 100000", 6),  # no quota: the affinity alone
    ],
)
def test_machine_cpus_is_the_affinity_within_the_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, affinity: int, cpu_max: str, expected: int
) -> None:
    _cgroup(tmp_path / "cgroup", {"cpu.max": cpu_max})
    (tmp_path / "membership").write_text("0::/\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
    found = _cpus.machine_cpus(str(tmp_path / "cgroup"), str(tmp_path / "membership"))
    assert found == expected


def test_this_machine_s_count_is_within_its_affinity() -> None:
    cpus = _cpus.machine_cpus()
    affinity = getattr(os, "sched_getaffinity", None)
    assert 1 <= cpus <= (len(affinity(0)) if affinity else os.cpu_count() or 1)

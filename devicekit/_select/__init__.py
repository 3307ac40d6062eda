"""Choosing a device: look, choose, wait, claim, explain.

What each backend lists (backends, nvml, hardware), what the launcher and the claim
files say (launch, claims, file locks), a pure ``choose()`` (selection), the DeviceManager
that acts on it, and the words of its CPU fallback (fallback), which the doctor builds on.
It stands on the base alone: selection never moves data.
"""

from devicekit._select._backends import (
    Backend,
    CpuBackend,
    DeviceInfo,
    Family,
    GpuProcess,
    builtin_backends,
    cuda_started,
    describe,
    who_uses,
)
from devicekit._select._claims import Holder, directory_problem
from devicekit._select._fallback import Finding, Machine, why_cpu
from devicekit._select._hardware import Build, Hardware, probe
from devicekit._select._launch import (
    LAUNCHERS,
    VISIBILITY_VARIABLES,
    BadRank,
    LocalRank,
    parse_visible_devices,
    repeated_visible_device,
    whole_number,
)
from devicekit._select._manager import DeviceManager, claim_holders, forget_process_default
from devicekit._select._selection import (
    Chosen,
    Outcome,
    RankProblem,
    Refused,
    Request,
    Seen,
    choose,
    family_notes,
)

__all__ = [
    "LAUNCHERS",
    "VISIBILITY_VARIABLES",
    "Backend",
    "BadRank",
    "Build",
    "Chosen",
    "CpuBackend",
    "DeviceInfo",
    "DeviceManager",
    "Family",
    "Finding",
    "GpuProcess",
    "Hardware",
    "Holder",
    "LocalRank",
    "Machine",
    "Outcome",
    "RankProblem",
    "Refused",
    "Request",
    "Seen",
    "builtin_backends",
    "choose",
    "claim_holders",
    "cuda_started",
    "describe",
    "directory_problem",
    "family_notes",
    "forget_process_default",
    "parse_visible_devices",
    "probe",
    "repeated_visible_device",
    "who_uses",
    "whole_number",
    "why_cpu",
]

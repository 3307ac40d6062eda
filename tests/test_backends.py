"""The built-in backends: CUDA visibility through NVML, and nothing started to look."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import devicekit as dk
from devicekit._select._backends import CpuBackend, CudaBackend, builtin_backends
from devicekit._select._launch import parse_visible_devices
from devicekit._select._nvml import NvmlGpu, visible_gpus

from .helpers import CPU, GiB
from .programs import run_program

if TYPE_CHECKING:
    from collections.abc import Iterator


def _gpu(number: int, capability: tuple[int, int] = (9, 0), free: int = 70) -> NvmlGpu:
    return NvmlGpu(
        uuid=f"GPU-{number}{number}{number}-{number:04d}",
        name=f"GPU model {capability[0]}",
        total_memory=80 * GiB,
        free_memory=free * GiB,
        pci_bus_id=f"00000000:{number + 1:02X}:00.0",
        capability=capability,
    )


ROOT = Path(__file__).resolve().parent.parent

FOUR = [_gpu(n, free=10 * (n + 1)) for n in range(4)]


def _visible(value: str | None, gpus: list[NvmlGpu] = FOUR, **environ: str) -> list[int]:
    if value is not None:
        environ["CUDA_VISIBLE_DEVICES"] = value
    return [gpus.index(gpu) for gpu in visible_gpus(gpus, environ)]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("2,0", [2, 0]),
        ("", []),
        ("-1", []),
        ("1,-1,3", [1]),
        ("0,0", []),
        ("1,7,2", [1]),
        ("7", []),
        (" 3 , 1", [3, 1]),
        ("1gpu,2", [1, 2]),
        ("GPU-222", [2]),
        ("GPU-333-0003,GPU-111", [3, 1]),
        ("GPU-", []),  # a prefix of every UUID: ambiguous, so nothing
        ("GPU-999", []),
        ("GPU-111,GPU-111", []),
    ],
)
def test_cuda_visible_devices_in_all_its_forms(value: str | None, expected: list[int]) -> None:
    assert _visible(value) == expected


def test_mig_ids_select_one_instance() -> None:
    migs = tuple(
        NvmlGpu(f"MIG-{n}aa-{n}", "H100 MIG 1g.10gb", 10 * GiB, 9 * GiB, "00000000:01:00.0")
        for n in range(2)
    )
    gpus = [NvmlGpu("GPU-abc", "H100", 80 * GiB, 60 * GiB, "00000000:01:00.0", (9, 0), migs)]
    found = visible_gpus(gpus, {"CUDA_VISIBLE_DEVICES": "MIG-1aa,MIG-0aa"})
    assert [gpu.uuid for gpu in found] == ["MIG-1aa-1"]  # CUDA shows one MIG instance


def test_cuda_order_puts_the_fastest_first_unless_pci_order_is_asked() -> None:
    mixed = [_gpu(0, (8, 0)), _gpu(1, (9, 0)), _gpu(2, (8, 6))]
    assert _visible(None, mixed) == [1, 2, 0]
    assert _visible(None, mixed, CUDA_DEVICE_ORDER="PCI_BUS_ID") == [0, 1, 2]
    assert _visible("0", mixed) == [1]  # index 0 is CUDA's first, not NVML's


@given(st.lists(st.sampled_from(["0", "1", "2", "3", "5", "-1", "", "x", "1a", " 2"]), max_size=5))
def test_index_lists_parse_as_pytorch_parses_them(tokens: list[str]) -> None:
    value = ",".join(tokens)
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    try:
        expected = torch.cuda._parse_visible_devices()
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
    assert parse_visible_devices(value) == expected


def test_cuda_backend_reports_visible_gpus_as_cuda_indices() -> None:
    backend = CudaBackend(nvml=lambda: FOUR, environ={"CUDA_VISIBLE_DEVICES": "3,1"}, compiled=True)
    infos = backend.devices()
    assert [info.device for info in infos] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert infos[0] == dk.DeviceInfo(
        torch.device("cuda", 0), "cuda", 0, "GPU model 9", 80 * GiB, 40 * GiB, (9, 0), FOUR[3].uuid
    )


def test_cuda_backend_says_when_visibility_hides_everything() -> None:
    backend = CudaBackend(nvml=lambda: FOUR, environ={"CUDA_VISIBLE_DEVICES": "-1"}, compiled=True)
    assert backend.devices() == []
    assert backend.note == "CUDA_VISIBLE_DEVICES='-1' hides all 4 GPU(s)"


def test_an_absurdly_long_index_hides_the_gpus_instead_of_raising() -> None:
    # int() refuses 4,301 digits; such an index names no GPU, as "7" does on four.
    value = "9" * 5000
    backend = CudaBackend(nvml=lambda: FOUR, environ={"CUDA_VISIBLE_DEVICES": value}, compiled=True)
    assert backend.devices() == []
    shown = f"'{'9' * 57}... (5,000 characters)"
    assert backend.note == f"CUDA_VISIBLE_DEVICES={shown} hides all 4 GPU(s)"
    assert _visible(f"2,{value},1") == [2]
    assert _visible(f"2,-{value},1") == [2]


def test_cuda_backend_says_when_pytorch_cannot_use_the_gpus() -> None:
    backend = CudaBackend(nvml=lambda: FOUR, environ={}, compiled=False)
    assert backend.devices() == []
    assert backend.note == "NVML sees 4 NVIDIA GPU(s), but this PyTorch build has no CUDA support"


def test_the_cpu_is_always_there() -> None:
    (info,) = CpuBackend().devices()
    assert info.device == CPU
    assert info.total_memory is None or info.total_memory > 0


def test_builtin_backends_end_with_the_cpu() -> None:
    backends = builtin_backends()
    assert [b.name for b in backends][-1] == "cpu"
    assert all(isinstance(backend, dk.Backend) for backend in backends)


def test_listing_devices_starts_no_cuda(fresh_python: str) -> None:
    code = (
        "import json, torch, devicekit as dk, warnings\n"
        "warnings.simplefilter('ignore')\n"
        "manager = dk.DeviceManager()\n"
        "print(json.dumps([torch.cuda.is_initialized(), str(manager.device)]))\n"
    )
    result = subprocess.run([fresh_python, "-c", code], capture_output=True, text=True, check=True)
    initialized, device = json.loads(result.stdout)
    assert initialized is False
    assert re.fullmatch(r"cpu|meta|(cuda|mps|xpu):\d+", device), device  # a device was chosen


_NOTHING_STARTED = """
import json, sys, warnings
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")  # the CPU fallback's
import devicekit as dk
from devicekit._select._backends import CpuBackend
from devicekit.cli import _info_json, _info_table
from tests.fakes import FakeGpus
started = []
STARTS = ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.fork", "os.forkpty", "os.system",
          "os.spawn")
sys.addaudithook(lambda event, args: started.append(event) if event in STARTS else None)
manager = dk.DeviceManager()
_info_table(manager), _info_json(manager)  # what `devicekit info` shows
claiming = dk.DeviceManager(claim=True, backends=[FakeGpus((70, 70)), CpuBackend()])
_info_table(claiming)
print(json.dumps(started))
"""


def test_looking_at_the_devices_starts_no_process(tmp_path: Path, fresh_python: str) -> None:
    # A process started while another thread forks can hang that fork's child, and one
    # per look is slow: detection reads files and libraries, never runs a program.
    environ = {**os.environ, "DEVICEKIT_CLAIM_DIR": str(tmp_path / "claims")}
    code = _NOTHING_STARTED.format(root=str(ROOT))
    result = run_program([fresh_python, "-c", code], timeout=120, env=environ)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == []


# Each program below holds, in a thread, a lock that detection or claiming could need,
# forks meanwhile, and has the child look at its devices (and claim one): the child must
# finish, where a lock left held would make it wait forever.
_FORK_RACE = """
import os, sys, threading, time, warnings
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")  # the CPU fallback's, and Python 3.12's about forking threads
import devicekit as dk
from devicekit._select import _claims
from devicekit._select import _nvml
from devicekit._select._backends import CpuBackend
from tests.fakes import FakeGpus
entered, release, forked = threading.Event(), threading.Event(), threading.Event()
{scenario}
thread = threading.Thread(target=held, daemon=True)
thread.start()
entered.wait(60)  # the thread holds its lock now, or has finished without needing one

def let_go():  # after the fork; or after a moment, where the fork waits for the thread
    forked.wait(0.5)
    release.set()

threading.Thread(target=let_go, daemon=True).start()
pid = os.fork()
if pid == 0:
    try:
        child()
    except BaseException as err:
        print("the child failed:", repr(err), flush=True)
        os._exit(1)
    os._exit(0)
forked.set()
deadline = time.monotonic() + 30
while not (done := os.waitpid(pid, os.WNOHANG))[0]:
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        sys.exit("the child hangs: it waits for a lock that a thread of its parent held")
    time.sleep(0.01)
sys.exit(os.waitstatus_to_exitcode(done[1]))
"""

_FIRST_LOOK = """
import subprocess
real = subprocess.check_output

def slow(*args, **kwargs):  # `uname -p`, which platform.processor() runs the first time
    entered.set()
    release.wait(60)
    return real(*args, **kwargs)

subprocess.check_output = slow

def held():
    dk.DeviceManager()  # this thread's first, the fork comes while it looks
    entered.set()

def child():
    dk.DeviceManager()
"""

_TEMP_DIRECTORY = """
import tempfile
assert tempfile.tempdir is None, "the temporary directory was looked for at import already"
real_open = os.open

def slow_open(*args, **kwargs):  # tempfile's first look writes a file where it looks
    if threading.current_thread() is thread and not entered.is_set():
        entered.set()
        release.wait(60)
    return real_open(*args, **kwargs)

os.open = slow_open

def held():
    tempfile.gettempdir()  # the program's first: it holds tempfile's lock while it looks
    entered.set()

def child():  # claims in $TMPDIR/devicekit-claims
    dk.DeviceManager(claim=True, fallback="error", backends=[FakeGpus((70,)), CpuBackend()])
    assert os.path.exists(os.path.join(os.environ["TMPDIR"], "devicekit-claims"))
"""

_NVML = """
import types

class NVMLError(Exception):
    pass

def nvml_init():  # nvidia-ml-py takes a lock of its own as NVML starts and stops
    with nvml.libLoadLock:
        if threading.current_thread() is thread:
            entered.set()
            release.wait(60)

nvml = types.SimpleNamespace(
    NVMLError=NVMLError, libLoadLock=threading.Lock(), nvmlInit=nvml_init,
    nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 0,
)
_nvml._binding = lambda: nvml

def held():
    _nvml.read_nvml()
    entered.set()

def child():
    assert _nvml.read_nvml() == []
"""

_CLAIM = """
real_open_lock = _claims._open_lock

def slow_open_lock(*args):
    if threading.current_thread() is thread:
        entered.set()
        release.wait(60)
    return real_open_lock(*args)

_claims._open_lock = slow_open_lock

def held():
    _claims.take("GPU-0000")
    entered.set()

def child():  # the parent's claim is not the child's: it takes the other GPU
    manager = dk.DeviceManager(claim=True, backends=[FakeGpus((70, 70)), CpuBackend()])
    assert str(manager.device) == "cuda:1", manager.explain()
"""

# The fallback's words come with devicekit: a first fallback that imported them (or
# anything) held that module's import lock, and a child forked then hung on its own.
_FALLBACK_IMPORT = """
class Pause:  # finds nothing: it holds the thread inside any import its first manager makes
    def find_spec(self, name, path=None, target=None):
        if threading.current_thread() is thread:
            entered.set()  # that module's import lock is this thread's now
            release.wait(60)
        return None

sys.meta_path.insert(0, Pause())

def held():
    dk.DeviceManager()  # the process's first CPU fallback
    entered.set()

def child():
    dk.DeviceManager()
"""


@pytest.mark.parametrize(
    "scenario",
    [_FIRST_LOOK, _TEMP_DIRECTORY, _NVML, _CLAIM, _FALLBACK_IMPORT],
    ids=["a first look", "tempfile's first look", "an NVML read", "a claim", "a fallback"],
)
def test_a_child_forked_while_a_thread_looks_or_claims_does_not_hang(
    tmp_path: Path, scenario: str, fresh_python: str
) -> None:
    environ = {**os.environ, "TMPDIR": str(tmp_path)}
    environ.pop("DEVICEKIT_CLAIM_DIR", None)
    code = _FORK_RACE.format(root=str(ROOT), scenario=scenario)
    result = run_program([fresh_python, "-c", code], timeout=120, env=environ)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]


# Forks at 30 moments of a thread's first DeviceManager, each from a process that has made
# none (the first fork of each trial): a child waits for no lock the thread held.
_FORKS_AT_ANY_MOMENT = """
import os, sys, threading, time, warnings
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")  # the CPU fallback's, and Python 3.12's about forking threads
import devicekit as dk
hung = []
for trial in range(30):
    delay = (trial % 15) / 1000
    pid = os.fork()
    if pid == 0:  # a process with no manager made yet
        threading.Thread(target=dk.DeviceManager, daemon=True).start()
        time.sleep(delay)
        child = os.fork()
        if child == 0:
            dk.DeviceManager()
            os._exit(0)
        deadline = time.monotonic() + 5
        while not (done := os.waitpid(child, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                os.kill(child, 9)
                os._exit(1)
            time.sleep(0.005)
        os._exit(os.waitstatus_to_exitcode(done[1]))
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status):
        hung.append(delay)
sys.exit(f"children forked after {{hung}} s hung or failed" if hung else 0)
"""


def test_children_forked_at_any_moment_of_a_thread_s_first_manager_do_not_hang(
    fresh_python: str,
) -> None:
    code = _FORKS_AT_ANY_MOMENT.format(root=str(ROOT))
    result = run_program([fresh_python, "-c", code], timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]


# On a GPU machine.


@pytest.fixture
def nvidia_smi() -> Iterator[list[list[str]]]:
    query = "--query-gpu=uuid,name,memory.total"
    try:
        result = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("nvidia-smi is not available")
    return [[cell.strip() for cell in line.split(",")] for line in result.stdout.splitlines()]


@pytest.mark.cuda
def test_device_info_agrees_with_nvidia_smi(nvidia_smi: list[list[str]]) -> None:
    infos = {info.uuid: info for info in CudaBackend().devices()}
    assert len(infos) == torch.cuda.device_count()
    for uuid, name, total_mib in nvidia_smi:
        if uuid in infos:
            assert infos[uuid].name == name
            assert infos[uuid].total_memory == int(total_mib) * 2**20


@pytest.mark.cuda
def test_free_memory_and_most_free_memory_see_another_process(fresh_python: str) -> None:
    before = {info.uuid: info.free_memory for info in CudaBackend().devices()}
    hog = subprocess.Popen(
        [
            fresh_python,
            "-c",
            (
                "import torch, sys; x = torch.empty(8 << 30, dtype=torch.uint8, device='cuda:0');"
                "torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()"
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hog.stdout is not None
        assert hog.stdout.readline().strip() == "ready"
        infos = CudaBackend().devices()
        first = infos[0]
        assert first.free_memory is not None
        assert before[first.uuid] is not None
        assert before[first.uuid] - first.free_memory >= 7 * GiB  # the other process's 8 GiB
        # NVML lists the other process on its GPU, and measures how busy the GPU is.
        assert first.processes, "NVML listed no process on the GPU another one fills"
        assert first.utilization is not None
        assert 0 <= first.utilization <= 1
        assert hog.pid in {process.pid for process in first.processes} or any(
            (process.used_memory or 0) >= 7 * GiB for process in first.processes
        )  # in a container NVML may give the host's pid; the 8 GiB it cannot hide
        if len(infos) >= 2:
            manager = dk.DeviceManager(policy="most-free-memory")
            assert manager.device != torch.device("cuda", 0)
    finally:
        hog.communicate("")


@pytest.mark.cuda
def test_once_cuda_started_gpus_are_matched_by_uuid() -> None:
    torch.cuda.init()
    infos = CudaBackend().devices()
    uuids = [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(len(infos))]
    assert [info.uuid for info in infos] == uuids


@pytest.mark.cuda
def test_a_forked_child_can_use_cuda_after_devices_were_listed(fresh_python: str) -> None:
    # In a fresh interpreter: once an earlier test has started CUDA in this process, no
    # forked child could use it, whatever devicekit does.
    program = """
import multiprocessing, torch, devicekit as dk
dk.DeviceManager()
assert not torch.cuda.is_initialized(), "listing devices started CUDA"
child = multiprocessing.get_context("fork").Process(
    target=lambda: torch.zeros(1, device="cuda").sum().item()
)
child.start()
child.join(60)
raise SystemExit(child.exitcode)
"""
    result = subprocess.run(
        [fresh_python, "-c", program], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr

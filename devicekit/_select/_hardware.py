"""Beneath PyTorch: the GPU drivers and device files of this machine, and PyTorch's build.

Whether an accelerator can be used depends on three things PyTorch does not report
together: the hardware and its driver (an NVIDIA kernel module, AMD's ``/dev/kfd``, an
Intel GPU's render node), what this process may open (a container started without
GPUs sees the driver but no device file), and what PyTorch was built for (CUDA, ROCm,
XPU, MPS, or the CPU only). :func:`probe` reads the first two from files, starting no
CUDA and no process; :meth:`Build.of_torch` reads the third from PyTorch's version
attributes. ``devicekit doctor`` and the CPU fallback's warning read both snapshots.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
from pathlib import Path
from typing import NamedTuple

import torch

from devicekit._base import current_accelerator
from devicekit._select._nvml import read_driver

__all__ = ["Build", "Hardware", "probe"]

_INTEL = "0x8086"  # the PCI vendor id a render node's device reports for an Intel GPU


class Hardware(NamedTuple):
    """The accelerators this machine has, as their drivers and device files show them."""

    nvidia_driver: str | None = None
    """The NVIDIA kernel module's version, "" where loaded but unread; None where not loaded."""
    nvidia_files: int = 0
    """How many ``/dev/nvidia0``, ``/dev/nvidia1``, ... device files this process sees."""
    nvidia_smi: bool = False
    """Whether ``nvidia-smi`` is on the PATH: shown, but no sign of a GPU by itself.

    The package that installs it stays after its driver is gone or fails to load (a
    kernel update the module was not built for), and on a machine that never had a GPU.
    """
    driver_cuda: tuple[int, int] | None = None
    """The newest CUDA the driver runs, as NVML says; None where NVML cannot be read."""
    amd_driver: bool = False
    """Whether the ``amdgpu`` kernel module is loaded."""
    kfd: bool = False
    """Whether ``/dev/kfd``, ROCm's compute device, is there for this process."""
    intel_gpus: int = 0
    """How many render nodes (``/dev/dri/renderD*``) belong to an Intel GPU."""
    system: str = ""
    """``platform.system()``: ``Linux``, ``Darwin``, ``Windows``."""
    arch: str = ""
    """The architecture this Python runs as: ``x86_64``, ``arm64``."""
    macos: tuple[int, ...] | None = None
    """The macOS version, such as ``(14, 5)``; None elsewhere."""

    @property
    def nvidia(self) -> bool:
        """Whether an NVIDIA GPU is there: its driver is loaded, or a device file is.

        ``nvidia-smi`` on the PATH alone is not enough (see :attr:`nvidia_smi`).

        >>> Hardware(nvidia_smi=True).nvidia, Hardware(nvidia_driver="").nvidia
        (False, True)
        """
        return self.nvidia_driver is not None or self.nvidia_files > 0

    @property
    def amd(self) -> bool:
        """Whether anything shows an AMD GPU: its kernel module or ``/dev/kfd``."""
        return self.amd_driver or self.kfd


class Build(NamedTuple):
    """What this PyTorch was built for.

    >>> Build("2.13.0+cu128", cuda="12.8").described, Build("2.13.0+cpu").described
    ('CUDA 12.8', 'the CPU only')
    """

    version: str
    """``torch.__version__``, such as ``2.13.0+cu128``."""
    cuda: str | None = None
    """``torch.version.cuda``, such as ``"12.8"``; None in other builds."""
    hip: str | None = None
    """``torch.version.hip``: the ROCm version of a ROCm build; None in other builds."""
    xpu: bool = False
    """Whether it was built for Intel GPUs."""
    mps: bool = False
    """Whether it was built with MPS, for Apple GPUs."""

    @classmethod
    def of_torch(cls) -> Build:
        """The installed PyTorch's build, read without starting any accelerator."""
        accelerator = current_accelerator()
        return cls(
            torch.__version__,
            torch.version.cuda,
            torch.version.hip,
            xpu=accelerator is not None and accelerator.type == "xpu",
            mps=torch.backends.mps.is_built(),
        )

    @property
    def described(self) -> str:
        """What it was built for, in words: ``CUDA 12.8``, ``ROCm 6.4``, ``the CPU only``."""
        if self.hip is not None:
            return f"ROCm {self.hip}"
        if self.cuda is not None:
            return f"CUDA {self.cuda}"
        return "XPU" if self.xpu else "MPS" if self.mps else "the CPU only"

    @property
    def release(self) -> str:
        """The version without its build tag, as ``pip install torch==`` takes it: ``2.13.0``."""
        return self.version.split("+")[0]


def probe(root: Path = Path("/"), path: str | None = None) -> Hardware:
    """This machine's GPU drivers and device files, read under ``root``; ``nvidia-smi`` on ``path``.

    Reads a few files and lists two folders; NVML only where something suggests the NVIDIA
    driver. The driver counts as there where the kernel module says so
    (``/proc/driver/nvidia/version``), where NVML answers, or (on Windows, which has no
    ``/proc``) where the driver's own library lies beside ``nvidia-smi``. Tests pass a
    folder laid out as a machine would be.
    """
    version_file = root / "proc/driver/nvidia/version"
    nvidia_driver = _module_version(version_file) if version_file.exists() else None
    # Device files come with the driver: /dev is listed only where /proc shows it (listing
    # its hundred-odd entries on every machine doubled the CPU fallback's DeviceManager()).
    listed = nvidia_driver is not None or not (root / "proc").is_dir()
    nvidia_files = _count(root / "dev", re.compile(r"nvidia\d+")) if listed else 0
    smi = shutil.which("nvidia-smi", path=path)
    driver = read_driver() if nvidia_driver is not None or nvidia_files or smi else None
    if driver is not None and not nvidia_driver:
        nvidia_driver = driver[0]  # NVML's, where /proc has none (Windows)
    if nvidia_driver is None and smi is not None and _driver_library_beside(Path(smi)):
        nvidia_driver = ""  # installed with its driver (Windows), version unread
    return Hardware(
        nvidia_driver=nvidia_driver,
        nvidia_files=nvidia_files,
        nvidia_smi=smi is not None,
        driver_cuda=None if driver is None else driver[1],
        amd_driver=(root / "sys/module/amdgpu").exists(),
        kfd=(root / "dev/kfd").exists(),
        intel_gpus=_intel_render_nodes(root),
        system=platform.system(),
        arch=os.uname().machine if hasattr(os, "uname") else platform.machine(),
        macos=_macos_version(),
    )


# The NVIDIA driver's own libraries (NVML, CUDA's driver API) on Windows: the driver puts
# nvidia-smi.exe beside them (System32, or NVSMI in older releases); no other package does.
_WINDOWS_DRIVER_LIBRARIES = ("nvml.dll", "nvcuda.dll")


def _driver_library_beside(smi: Path) -> bool:
    """Whether the NVIDIA driver's own library lies beside this ``nvidia-smi`` (Windows)."""
    return any((smi.parent / name).is_file() for name in _WINDOWS_DRIVER_LIBRARIES)


def _module_version(version_file: Path) -> str:
    """The driver version the NVIDIA kernel module states, "" where the file says none.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     file = Path(folder) / "version"
    ...     _ = file.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  "
    ...                         "570.86.15  Release Build  (dvs-builder@U16-I3-B03-4-3)")
    ...     _module_version(file)
    '570.86.15'
    """
    try:
        text = version_file.read_text(errors="replace")
    except OSError:  # there, but not for this user to read
        return ""
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return "" if found is None else found.group(1)


def _count(folder: Path, name: re.Pattern[str]) -> int:
    try:
        return sum(1 for entry in os.scandir(folder) if name.fullmatch(entry.name))
    except OSError:  # no such folder (Windows, a sandbox)
        return 0


def _intel_render_nodes(root: Path) -> int:
    """Render nodes whose GPU is Intel's, by the PCI vendor id sysfs gives for each."""
    drm = root / "sys/class/drm"
    count = 0
    for node in sorted(drm.glob("renderD*")) if drm.is_dir() else ():
        try:
            vendor = (node / "device/vendor").read_text().strip()
        except OSError:
            continue
        count += vendor == _INTEL
    return count


def _macos_version() -> tuple[int, ...] | None:
    if platform.system() != "Darwin":
        return None
    release = platform.mac_ver()[0]  # read from a system file: no process started
    return tuple(int(part) for part in release.split(".") if part.isdecimal()) or None

"""A GPU's PCIe link through NVML, and the seam the loader asks it through (``link_peak``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

import devicekit  # noqa: F401 - registers the selection part's link reader, as users get it
from devicekit._base import LinkPeak, _devices, link_peak, register_link_reader
from devicekit._select import _nvml

from .fakes import LINK_READERS, NvmlError, fake_pynvml

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

GEN5_X16 = {"max_generation": 5, "max_width": 16, "generation": 5, "width": 16}
IDLE_GEN5_X16 = {"max_generation": 5, "max_width": 16, "generation": 1, "width": 16}


@pytest.fixture(autouse=True)
def _fresh_links() -> Iterator[None]:
    """Each test starts with nothing kept, and leaves devicekit's own reader registered."""
    _devices._links.clear()
    yield
    register_link_reader(_nvml.read_link)


def _pynvml(
    monkeypatch: pytest.MonkeyPatch, links: list[Mapping[str, int]], **options: int
) -> list[str]:
    """Make NVML read ``links`` (see fake_pynvml); the names of the calls made come back."""
    calls: list[str] = []
    fake = fake_pynvml(links, calls=calls, **options)
    monkeypatch.setattr(_nvml, "_binding", lambda: fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    return calls


@pytest.mark.parametrize(
    ("figures", "expected"),
    [
        (GEN5_X16, LinkPeak(5, 16, 32 * 128 / 130 / 8 * 16)),
        # Idle: the current generation drops to save power; the maximum is what copies get.
        (IDLE_GEN5_X16, LinkPeak(5, 16, 32 * 128 / 130 / 8 * 16)),
        # A gen4 x8 slot: NVML's maximum is the GPU's and the slot's both.
        ({"max_generation": 4, "max_width": 8}, LinkPeak(4, 8, 16 * 128 / 130 / 8 * 8)),
        # No maximum where the board does not say: the current figures stand in.
        ({"generation": 3, "width": 16}, LinkPeak(3, 16, 8 * 128 / 130 / 8 * 16)),
        ({"max_generation": 6, "width": 16}, LinkPeak(6, 16, 64 * 242 / 256 / 8 * 16)),
        ({"max_generation": 1, "max_width": 1}, LinkPeak(1, 1, 0.25)),
        ({}, None),  # nothing supported
        ({"max_generation": 5}, None),  # no width
        ({"max_generation": 7, "max_width": 16}, None),  # a generation devicekit cannot rate
    ],
    ids=[
        "gen5 x16",
        "gen5 x16 idling at gen1",
        "gen4 x8",
        "only the current",
        "gen6",
        "gen1 x1",
        "none",
        "no width",
        "gen7",
    ],
)
def test_the_link_is_read_at_its_maximum_else_as_it_is(
    monkeypatch: pytest.MonkeyPatch, figures: Mapping[str, int], expected: LinkPeak | None
) -> None:
    _pynvml(monkeypatch, [figures])
    gpus = _nvml.read_nvml(links=True)
    assert gpus is not None
    assert gpus[0].link == expected


def test_the_peaks_are_the_line_rates_pci_sig_gives() -> None:
    # GB/s per direction at x16, as PCI-SIG's tables round them.
    x16 = [_nvml.pcie_peak(generation, 16) for generation in range(1, 7)]
    assert [round(peak or 0, 1) for peak in x16] == [4.0, 8.0, 15.8, 31.5, 63.0, 121.0]
    assert _nvml.pcie_peak(0, 16) is None
    assert _nvml.pcie_peak(5, -1) is None


def test_a_link_reads_as_its_figures() -> None:
    assert str(LinkPeak(5, 16, 63.015)) == "PCIe gen5 x16, 63 GB/s"
    assert str(LinkPeak(3, 16, 15.75)) == "PCIe gen3 x16, 15.8 GB/s"
    assert str(LinkPeak(6, 16, 121.0)) == "PCIe gen6 x16, 121 GB/s"


def test_listing_devices_reads_no_link(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _pynvml(monkeypatch, [GEN5_X16])
    gpus = _nvml.read_nvml()
    assert gpus is not None
    assert gpus[0].link is None
    assert not set(LINK_READERS.values()) & set(calls)


def test_mig_instances_share_their_gpu_s_link(monkeypatch: pytest.MonkeyPatch) -> None:
    _pynvml(monkeypatch, [GEN5_X16], migs=2)
    gpus = _nvml.read_nvml(links=True)
    assert gpus is not None
    assert [mig.uuid for mig in gpus[0].mig] == ["MIG-0-0", "MIG-0-1"]
    assert {mig.link for mig in gpus[0].mig} == {gpus[0].link}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0-1")
    assert _nvml.read_link(torch.device("cuda", 0)) == gpus[0].link


def test_a_cuda_index_is_the_gpu_cuda_shows_there(monkeypatch: pytest.MonkeyPatch) -> None:
    _pynvml(monkeypatch, [GEN5_X16, {"max_generation": 4, "max_width": 16}])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert _nvml.read_link(torch.device("cuda", 0)) == LinkPeak(4, 16, 16 * 128 / 130 / 8 * 16)
    assert _nvml.read_link(torch.device("cuda", 1)) is None  # hidden
    assert _nvml.read_link(torch.device("cuda")) == _nvml.read_link(torch.device("cuda", 0))


def test_a_started_cuda_names_its_gpu_by_uuid() -> None:
    a, b = (
        _nvml.NvmlGpu(f"GPU-{n}", "H100", 80, 70, f"0000:0{n}", link=LinkPeak(n, 16, 1.0))
        for n in (4, 5)
    )
    # CUDA's index 0 is GPU-5 whatever the environment would say (it may have changed).
    assert _nvml.gpu_of(0, [a, b], {}, uuid="5") is b
    assert _nvml.gpu_of(0, [a, b], {}, uuid="6") is None
    assert _nvml.gpu_of(0, [a, b], {}) is a


def test_no_nvml_no_link(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nvml, "_binding", lambda: None)  # pynvml not installed
    assert _nvml.read_link(torch.device("cuda", 0)) is None
    fake = fake_pynvml([GEN5_X16])

    def no_driver() -> None:
        raise NvmlError

    fake.nvmlInit = no_driver
    monkeypatch.setattr(_nvml, "_binding", lambda: fake)
    assert _nvml.read_link(torch.device("cuda", 0)) is None


def test_nvml_is_read_under_the_fork_lock_and_for_cuda_devices_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _pynvml(monkeypatch, [GEN5_X16])
    fake = _nvml._binding()
    held = []
    fake.nvmlInit = lambda: held.append(_nvml._reading.locked())
    for device in ("cpu", "meta", "mps", "xpu:0"):
        assert link_peak(torch.device(device)) is None
    assert not calls
    assert not held
    assert link_peak(torch.device("cuda", 0)) == LinkPeak(5, 16, 32 * 128 / 130 / 8 * 16)
    assert held == [True]


def test_devicekit_registers_its_nvml_reader() -> None:
    assert _devices._link_reader is _nvml.read_link


def test_each_device_s_link_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[torch.device] = []

    def read(device: torch.device) -> LinkPeak | None:
        asked.append(device)
        return LinkPeak(5, 16, 63.0) if device.index == 0 else None

    register_link_reader(read)
    zero, one = torch.device("cuda", 0), torch.device("cuda", 1)
    assert [link_peak(zero), link_peak(one), link_peak(zero), link_peak(one)] == [
        LinkPeak(5, 16, 63.0),
        None,
        LinkPeak(5, 16, 63.0),
        None,
    ]
    assert asked == [zero, one]  # an unknown link is kept too
    # "cuda" is whichever device is current when asked: never kept.
    link_peak(torch.device("cuda"))
    link_peak(torch.device("cuda"))
    assert asked[2:] == [torch.device("cuda")] * 2
    register_link_reader(lambda device: LinkPeak(4, 16, 31.5))  # a new reader forgets
    assert link_peak(zero) == LinkPeak(4, 16, 31.5)


@pytest.mark.parametrize(
    ("c2c", "expected"),
    [
        ({"c2c": 1}, None),  # a GH200: host copies run over NVLink-C2C, not its PCIe link
        ({"c2c": 0}, LinkPeak(5, 16, 32 * 128 / 130 / 8 * 16)),
        ({}, LinkPeak(5, 16, 32 * 128 / 130 / 8 * 16)),  # a driver that cannot tell: PCIe
    ],
    ids=["c2c", "pcie", "unknown"],
)
def test_a_gpu_reaching_the_host_over_nvlink_c2c_is_judged_against_no_pcie_link(
    c2c: dict[str, int], expected: LinkPeak | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pynvml(monkeypatch, [{**GEN5_X16, **c2c}])
    assert _nvml.read_link(torch.device("cuda", 0)) == expected

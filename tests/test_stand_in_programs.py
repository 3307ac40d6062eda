"""Programs run on the stand-in accelerator in a fresh interpreter (the slow tier).

What needs a process of its own: an example started as a user starts it, and a
stand-in started with a capacity (``memory=``), which a process sets once.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .programs import run_program

EXAMPLES = Path(__file__).parent.parent / "examples"

# Runs an example as `python examples/NAME --epochs 2 --device ...` would, the stand-in
# started first where the device is one of its own; argv[1:] are the example's path, the
# device, and a line of its source to take out ("" for none).
_RUN_EXAMPLE = """
import sys
path, device, removed = sys.argv[1:]
if device.startswith("standin"):
    import devicekit.testing
    devicekit.testing.stand_in()
source = open(path).read()
if removed:
    assert removed in source
    source = source.replace(removed, "pass")
sys.argv = [path, "--epochs", "2", "--device", device]
exec(compile(source, path, "exec"), {"__name__": "__main__", "__file__": path})
"""


def _example(python: str, name: str, device: str, removed: str = "") -> tuple[int, str, str]:
    command = [python, "-c", _RUN_EXAMPLE, str(EXAMPLES / name), device, removed]
    result = run_program(command, timeout=300)
    return result.returncode, result.stdout, result.stderr


@pytest.mark.parametrize("name", ["cnn.py", "linear_regression.py"])
def test_an_example_trains_on_the_stand_in_as_on_the_cpu(fresh_python: str, name: str) -> None:
    status, on_cpu, _ = _example(fresh_python, name, "cpu")
    assert status == 0
    status, on_stand_in, said = _example(fresh_python, name, "standin:1")
    assert status == 0, said[-3000:]
    assert on_cpu.count("loss") >= 2  # each epoch's loss, printed
    assert on_stand_in.replace("standin:1", "cpu") == on_cpu  # a line may name the device


def test_the_cnn_example_prints_each_epoch_s_loss_and_accuracy(fresh_python: str) -> None:
    status, out, said = _example(fresh_python, "cnn.py", "standin:0")
    assert status == 0, said[-3000:]
    assert re.fullmatch(r"(epoch \d: loss \d\.\d{6}, accuracy \d+\.\d%\n){2}", out)


def test_the_cnn_example_without_its_model_move_fails_naming_both_devices(
    fresh_python: str,
) -> None:
    removed = "model = dk.to_device(model, manager.device)"
    status, _, said = _example(fresh_python, "cnn.py", "standin:0", removed)
    assert status != 0
    assert "input is on standin:0 but the parameters of Sequential (e.g. 0.weight" in said
    assert "are on cpu" in said


_FIT = """
import torch, devicekit as dk, devicekit.testing
name = devicekit.testing.stand_in(memory="64MiB")
device = torch.device(name, 0)
model = torch.nn.Linear(1024, 1024).to(device)  # 4 MiB of weights, 4 of gradients
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

def step(batch_size):
    optimizer.zero_grad(set_to_none=True)
    model(torch.ones(batch_size, 1024, device=device)).sum().backward()
    optimizer.step()

def fits(batch_size):
    try:
        step(batch_size)
    except torch.OutOfMemoryError:
        return False
    return True

low, high = 1, 1 << 16  # the largest size that fits, found by bisection
while low + 1 < high:
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle) else (low, middle)
fit = dk.fit_batch(step, device=device, restore=(model, optimizer))
try:
    step(low + 1)
except Exception as error:
    kind = type(error).__name__
print(low, fit.batch_size, kind)
"""


def test_fit_batch_finds_the_largest_batch_under_a_capacity(fresh_python: str) -> None:
    result = run_program([fresh_python, "-c", _FIT], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    largest, found, kind = result.stdout.split()
    assert kind == "OutOfMemoryError"
    assert 0.9 * int(largest) <= int(found) <= int(largest)


_LEAVES_REGISTERED = """
import torch, devicekit.testing
devicekit.testing.stand_in()
kept = torch.empty(8192, dtype=torch.uint8)
torch.standin.host_register(kept)
given_back = torch.empty(4096, dtype=torch.uint8)
torch.standin.host_register(given_back)
torch.standin.host_unregister(given_back)
"""


def test_registrations_left_at_exit_are_named(fresh_python: str) -> None:
    result = run_program([fresh_python, "-c", _LEAVES_REGISTERED], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stderr.splitlines()
    assert said[-2] == "devicekit stand-in: host memory still registered at exit:"
    assert re.fullmatch(r"  8\.0 KiB at 0x[0-9a-f]+, registered by host_register", said[-1])

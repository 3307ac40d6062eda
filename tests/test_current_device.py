"""The default device of calls given no device: the open manager, a `with` block, or neither.

On this machine the process default is the CPU; ``meta`` stands in for a second device.
"""

from __future__ import annotations

import asyncio
import gc
import pickle
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import devicekit as dk
from devicekit._base import _current

from .helpers import CPU, META

HERE = Path(__file__).name


@pytest.fixture(autouse=True)
def process_default_is_the_cpu() -> None:
    assert not _current._open, "a manager of an earlier test is still open"
    assert dk.current_device() == CPU


def test_a_manager_kept_open_is_the_device_of_every_call_given_none() -> None:
    manager = dk.DeviceManager("meta")
    assert dk.current_device() == META
    assert dk.to_device(torch.ones(2)).device == META
    assert dk.to_device(torch.nn.Linear(2, 2)).weight.device == META
    assert dk.DeviceDataLoader([torch.ones(2)]).device == META
    manager.close()
    assert dk.current_device() == CPU


def test_a_manager_from_env_counts_as_the_constructor_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEVICEKIT_DEVICE", "meta")
    manager = dk.DeviceManager.from_env()
    assert dk.to_device(torch.ones(2)).device == META
    manager.close()


def test_a_manager_nobody_holds_stops_counting() -> None:
    device = dk.DeviceManager("meta").device  # the manager itself is dropped at once
    assert device == META
    assert dk.current_device() == CPU
    manager = dk.DeviceManager("meta")
    del manager
    gc.collect()  # CPython frees it at once; the collector, for other interpreters
    assert dk.to_device(torch.ones(2)).device == CPU


def test_a_closed_manager_is_no_longer_the_default_and_closing_twice_does_nothing() -> None:
    manager = dk.DeviceManager("meta")
    manager.close()
    manager.close()
    assert dk.to_device(torch.ones(2)).device == CPU


def test_managers_that_agree_share_the_default() -> None:
    first, second = dk.DeviceManager("meta"), dk.DeviceManager("meta")
    assert dk.current_device() == META
    first.close()
    assert dk.current_device() == META
    second.close()


def test_managers_that_disagree_refuse_a_call_given_no_device_naming_both() -> None:
    meta = dk.DeviceManager("meta")
    meta_line = _line_of("meta = dk.DeviceManager")
    cpu = dk.DeviceManager("cpu")
    cpu_line = _line_of("cpu = dk.DeviceManager")
    expected = (
        "Expected the open DeviceManagers to agree on one device for a devicekit call given "
        "no device, found 2 that chose different ones: meta (made at "
    )
    for call in (
        dk.current_device,
        lambda: dk.to_device(torch.ones(2)),
        lambda: dk.DeviceDataLoader([1]),
    ):
        with pytest.raises(dk.DeviceKitError, match=re.escape(expected)) as caught:
            call()
        message = str(caught.value)
        assert f"{HERE}:{meta_line}) and cpu (made at " in message
        assert message.endswith(
            f"{HERE}:{cpu_line}). Pass device= to the call, run it inside `with manager:` in "
            "this thread (a block applies only in the thread or asyncio task that entered it), "
            "or close() the managers you no longer use: devicekit.DeviceManager.close_all() "
            "closes every one, also those you no longer hold."
        )
    # A device given, or a block, says which: no refusal.
    assert dk.to_device(torch.ones(2), "meta").device == META
    with cpu:
        assert dk.to_device(torch.ones(2)).device == CPU
    # Leaving the block closed `cpu`: the one open manager left is the default again.
    assert dk.current_device() == META
    meta.close()


def _line_of(text: str) -> int:
    source = Path(__file__).read_text().splitlines()
    return next(number for number, line in enumerate(source, 1) if line.strip().startswith(text))


def test_a_with_block_wins_inside_it_and_the_open_manager_outside() -> None:
    outer = dk.DeviceManager("meta")
    with dk.DeviceManager("cpu"):
        assert dk.current_device() == CPU
        with outer:
            assert dk.current_device() == META
        assert dk.current_device() == CPU
    # Leaving its block closed `outer`, as close() says: the process default again.
    assert dk.current_device() == CPU


def test_leaving_a_with_block_closes_its_manager() -> None:
    manager = dk.DeviceManager("meta")
    with manager:
        assert dk.current_device() == META
    assert dk.current_device() == CPU  # closed: the process default again


def test_a_loader_keeps_the_device_it_was_made_with() -> None:
    before = dk.DeviceDataLoader([torch.ones(2)])
    manager = dk.DeviceManager("meta")
    after = dk.DeviceDataLoader([torch.ones(2)])
    assert [batch.device for batch in before] == [CPU]
    assert [batch.device for batch in after] == [META]
    manager.close()
    assert [batch.device for batch in after] == [META]  # made while meta was the default


def test_the_open_manager_is_the_default_of_every_thread() -> None:
    seen: dict[str, torch.device] = {}
    made: list[dk.DeviceManager] = []

    def look(name: str) -> None:
        seen[name] = dk.current_device()

    manager = dk.DeviceManager("meta")
    thread = threading.Thread(target=look, args=("made in the main thread",))
    thread.start()
    thread.join()
    manager.close()

    thread = threading.Thread(target=lambda: made.append(dk.DeviceManager("meta")))
    thread.start()
    thread.join()
    look("made in another thread")
    made.pop().close()
    look("closed")
    assert seen == {
        "made in the main thread": META,
        "made in another thread": META,
        "closed": CPU,
    }


def test_a_with_block_stays_in_its_thread_and_its_manager_is_open_in_all() -> None:
    open_manager = dk.DeviceManager("meta")
    inside, entered, done = [], threading.Event(), threading.Event()

    def in_a_block() -> None:
        with dk.DeviceManager("cpu"):
            inside.append(dk.current_device())
            entered.set()
            done.wait(10)

    thread = threading.Thread(target=in_a_block)
    thread.start()
    assert entered.wait(10)
    try:  # here, outside any block, two open managers disagree
        with pytest.raises(dk.DeviceKitError, match="found 2 that chose different ones"):
            dk.current_device()
    finally:
        done.set()
        thread.join()
    assert inside == [CPU]
    assert dk.current_device() == META  # the block's manager closed as it ended
    open_manager.close()


def test_the_process_default_does_not_count_as_an_open_manager() -> None:
    # Built by the fixture's call: a manager made now is not refused against it.
    assert not _current._open
    manager = dk.DeviceManager("meta")
    assert dk.current_device() == META
    manager.close()


def test_explain_states_the_rule_while_open_and_says_when_closed() -> None:
    manager = dk.DeviceManager("meta")
    assert (
        "Default: devicekit calls given no device use meta until close(), outside other "
        "managers' `with` blocks."
    ) in manager.explain().splitlines()
    manager.close()
    assert (
        "Default: closed, so devicekit calls given no device no longer use it."
        in manager.explain().splitlines()
    )


# A block's manager counts its blocks in every thread, and is never the answer once closed.


@pytest.mark.usefixtures("watchdog")
def test_a_manager_entered_in_two_threads_stays_open_until_the_last_leaves() -> None:
    manager = dk.DeviceManager("meta")
    entered, leave = threading.Event(), threading.Event()
    seen: list[torch.device] = []

    def in_a_block() -> None:
        with manager:
            entered.set()
            leave.wait(10)
            seen.append(dk.current_device())

    thread = threading.Thread(target=in_a_block)
    thread.start()
    try:
        assert entered.wait(10)
        with manager:
            pass
        # This thread's block ended, the other thread's has not: the manager is open still.
        assert dk.current_device() == META
    finally:
        leave.set()
        thread.join(10)
    assert not thread.is_alive()
    assert seen == [META]
    assert dk.current_device() == CPU  # the last block ended: closed


def test_a_block_left_in_another_thread_is_passed_over_by_the_generator_s_caller() -> None:
    def batches() -> Iterator[int]:
        with dk.DeviceManager("meta"):
            yield 1
            yield 2

    suspended = batches()
    next(suspended)  # the block is open, its entry in this thread's context
    assert dk.current_device() == META
    thread = threading.Thread(target=lambda: list(suspended))  # the block ends there
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert dk.current_device() == CPU  # its manager closed: not the answer here either


def test_a_block_whose_manager_was_closed_inside_it_is_passed_over() -> None:
    open_manager = dk.DeviceManager("meta")
    with dk.DeviceManager("cpu") as manager:
        assert dk.current_device() == CPU
        manager.close()
        assert dk.current_device() == META  # as if the block were not there
    open_manager.close()


def test_a_task_or_callback_made_inside_a_block_passes_it_over_once_it_closed() -> None:
    seen: dict[str, torch.device] = {}

    async def later(name: str) -> None:
        seen[name] = dk.current_device()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with dk.DeviceManager("meta"):
            # Each copies this context, the block's entry with it, and runs after it ends.
            task = asyncio.create_task(later("task"))
            loop.call_soon(lambda: seen.setdefault("callback", dk.current_device()))
        await task

    asyncio.run(main())
    assert seen == {"task": CPU, "callback": CPU}


def test_a_thread_started_inside_a_block_is_told_blocks_apply_in_their_own_thread() -> None:
    meta, cpu = dk.DeviceManager("meta"), dk.DeviceManager("cpu")
    said: list[str] = []

    def call() -> None:
        try:
            dk.current_device()
        except dk.DeviceKitError as err:
            said.append(str(err))

    with cpu:
        thread = threading.Thread(target=call)
        thread.start()
        thread.join(10)
    assert not thread.is_alive()
    assert len(said) == 1
    assert (
        "Pass device= to the call, run it inside `with manager:` in this thread (a block "
        "applies only in the thread or asyncio task that entered it)"
    ) in said[0]
    meta.close()


def test_close_all_closes_managers_no_name_holds_and_the_refusal_names_it() -> None:
    made_at = f"{__file__}:{_line_of('out[cell] = dk.DeviceManager')}"
    out: dict[int, dk.DeviceManager] = {}  # a notebook's Out[], which the user never reads
    for cell, device in enumerate(("meta", "cpu", "meta", "cpu", "meta")):
        out[cell] = dk.DeviceManager(device)
    expected = (
        "found 5 that chose different ones: "
        f"meta (made at {made_at}), cpu (made at {made_at}), meta (made at {made_at}) and 2 "
        "more. Pass device= to the call, run it inside `with manager:` in this thread (a "
        "block applies only in the thread or asyncio task that entered it), or close() the "
        "managers you no longer use: devicekit.DeviceManager.close_all() closes every one, "
        "also those you no longer hold."
    )
    with pytest.raises(dk.DeviceKitError, match=re.escape(expected)):
        dk.current_device()
    dk.DeviceManager.close_all()
    assert dk.current_device() == CPU
    assert "Default: closed" in out[4].explain()


def test_a_manager_in_a_reference_cycle_is_closed_by_close_all() -> None:
    class Trainer:
        def __init__(self) -> None:
            self.manager = dk.DeviceManager("meta")
            self.me = self  # a cycle: only the collector frees it

    gc.disable()  # the collector would close it on its own: that is not the point here
    try:
        Trainer()
        keep = dk.DeviceManager("cpu")
        with pytest.raises(dk.DeviceKitError, match="found 2 that chose different ones"):
            dk.current_device()
        dk.DeviceManager.close_all()
        assert dk.current_device() == CPU
        assert "Default: closed" in keep.explain()
    finally:
        gc.enable()


def test_pickling_a_manager_says_to_send_its_device() -> None:
    manager = dk.DeviceManager("meta")
    expected = (
        "Expected something another process can use, got DeviceManager(device=device("
        "type='meta')) to pickle (as multiprocessing does with what it sends to a process): "
        "a manager is this process's own, with its claim and its place as the default "
        "device. Send its device instead (manager.device, a torch.device), and pass it to "
        "devicekit calls there, or to DeviceManager(device) for a manager of that process."
    )
    with pytest.raises(TypeError, match=re.escape(expected)):
        pickle.dumps(manager)
    assert pickle.loads(pickle.dumps(manager.device)) == META
    manager.close()

"""fit_batch under a process group: every rank makes the same collective calls, in order.

A rank that makes a collective call the others do not make waits for them for good.
So the search agrees everything it branches on: the options, before the first try, in
one all-reduce (ranks given different ones all refuse, together); then every try's
outcome, in one all-reduce (MIN) each, so all ranks take the same sizes and end on the
same one; a rank whose step fails otherwise tells the others before it raises.

A step that synchronises a DistributedDataParallel's gradients cannot keep that
promise (a rank out of memory inside it leaves the others in its all-reduce): where
the wrapper is named in ``restore=``, :class:`Watch` sees it, and the search refuses
after the first try, on every rank.

Without a process group each agreement is the rank's own value, and nothing is sent.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
from torch import nn

from devicekit._base import DeviceKitError, current_device, ddp_forward_syncs, shown

__all__ = ["AGREED", "Ranks", "Watch", "ddp_wrappers"]


def ddp_wrappers(entries: Sequence[object]) -> list[nn.parallel.DistributedDataParallel]:
    """The DistributedDataParallel modules named in ``restore=``, or held by one named there."""
    found: dict[int, nn.parallel.DistributedDataParallel] = {}
    for entry in entries:
        if isinstance(entry, nn.Module):
            for module in entry.modules():
                if isinstance(module, nn.parallel.DistributedDataParallel):
                    found[id(module)] = module
    return list(found.values())


AGREED: Final = ("start", "limit", "target", "headroom", "wrappers")
"""The options that shape the search, so that every rank must be given the same."""


class Ranks:
    """This process's place in a process group, if any, and the all-reduces of the search."""

    def __init__(self) -> None:
        distributed = torch.distributed
        self.grouped = distributed.is_available() and distributed.is_initialized()
        self.count = distributed.get_world_size() if self.grouped else 1
        self.device = torch.device("cpu")  # where gloo and the others reduce

    def agree_on(
        self,
        options: dict[str, int | float | None],
        refusal: Exception | None,
        device: torch.device | None,
    ) -> None:
        """Refuse, on every rank at once, options that are out of range or differ.

        One all-reduce (MIN) of ``[ok, code, -code, ...]`` gives every rank whether all
        are ready, and the least and the most of each option over the ranks.
        """
        if self.grouped and torch.distributed.get_backend() == "nccl":
            # NCCL reduces on the device only: the search's, or (refused) the current one.
            self.device = current_device() if device is None else device
        if not self.grouped:
            if refusal is not None:
                raise refusal
            return
        codes = [0] * len(AGREED) if refusal is not None else [_code(options[n]) for n in AGREED]
        agreed = self.least([int(refusal is None), *(x for code in codes for x in (code, -code))])
        if refusal is not None:
            raise refusal
        if agreed[0] == 0:
            msg = (
                "Cannot fit the batch: another rank's fit_batch refused its arguments "
                "before the first try (its own error says why), so this rank stops too."
            )
            raise DeviceKitError(msg)
        differ = []
        for index, name in enumerate(AGREED):
            least, most = agreed[1 + 2 * index], -agreed[2 + 2 * index]
            if least != most:
                differ.append(_differs(name, least, most))
        if differ:
            msg = (
                f"{'; '.join(differ)}. Pass the same start, limit, target, headroom and "
                "restore= on every rank: ranks that search differently make different "
                "collective calls, and the group goes out of step. No rank tried a size."
            )
            raise DeviceKitError(msg)

    def smallest(self, value: int) -> int:
        """The smallest of every rank's ``value``: one all-reduce (MIN) under a group.

        Every branch of the search follows values agreed so, so that every rank takes
        the same sizes and makes the same collective calls: none waits for another.
        """
        return value if not self.grouped else self.least([value])[0]

    def least(self, values: list[int]) -> list[int]:
        """The least of each of ``values`` over the ranks (one all-reduce)."""
        distributed = torch.distributed
        flags = torch.tensor(values, device=self.device, dtype=torch.int64)
        try:
            distributed.all_reduce(flags, op=distributed.ReduceOp.MIN)
        except RuntimeError as error:
            msg = (
                "Expected every rank to reach fit_batch's all-reduce, but it failed: a rank "
                "left the search, or the ranks' collective calls went out of step. A rank "
                "that runs out of memory inside a step of DistributedDataParallel leaves the "
                "others in its gradient all-reduce: search with the module outside its "
                "wrapper (ddp.module) or under ddp.no_sync() (see the guide, 'The largest "
                f"batch that fits'). The process group said: {error}"
            )
            raise DeviceKitError(msg) from error
        return [int(each) for each in flags.tolist()]


def _code(value: int | float | None) -> int:
    """An option as a whole number: None 0, a share its float's bits (ordered, as it is >= 0)."""
    if value is None:
        return 0
    if isinstance(value, float):
        bits: int = struct.unpack("<q", struct.pack("<d", value + 0.0))[0]  # -0.0 is 0.0
        return bits
    return min(int(value), 2**62)  # in an int64, negated too; no batch is larger


def _differs(name: str, least: int, most: int) -> str:
    if name == "wrappers":
        return (
            "restore= names a different number of DistributedDataParallel modules on "
            f"different ranks: {least} on some, {most} on others"
        )

    def said(code: int) -> str:
        if name == "headroom":
            return shown(struct.unpack("<d", struct.pack("<q", code))[0])
        return "None" if code == 0 else str(code)

    return f"{name} differs between ranks: {said(least)} on some, {said(most)} on others"


class Watch:
    """The DistributedDataParallel modules named in ``restore=``: what each try synchronised.

    A forward pre-hook reads what the forward is about to synchronise, a forward hook
    that it ended. Both are removed when the search ends.
    """

    def __init__(self, wrappers: Sequence[nn.Module]) -> None:
        self.wrappers = wrappers
        self.handles: list[Any] = []
        self.gradients = False
        """A forward of this try began that synchronises gradients in its backward."""
        self.broadcasting: set[int] = set()
        """The wrappers whose forward began broadcasting buffers and did not end."""

    def __enter__(self) -> Watch:
        for wrapper in self.wrappers:
            self.handles.append(wrapper.register_forward_pre_hook(self._began))
            self.handles.append(wrapper.register_forward_hook(self._ended))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def start(self) -> None:
        self.gradients, self.broadcasting = False, set()

    def _began(self, module: nn.Module, args: object) -> None:
        syncs = ddp_forward_syncs(module)
        self.gradients = self.gradients or syncs.gradients
        if syncs.buffers:
            self.broadcasting.add(id(module))

    def _ended(self, module: nn.Module, args: object, output: object) -> None:
        self.broadcasting.discard(id(module))

    def stop_where_out_of_step(
        self, size: int, out_of_memory: BaseException | None, tell_the_others: Callable[[], None]
    ) -> None:
        """Raise where a DistributedDataParallel named in restore= makes agreeing unsafe.

        Gradients synchronised in a try: on every rank, at the same try, since every
        rank runs the same step; none calls the all-reduce of the try, which a rank
        out of memory inside the step would meet with DDP's own. A forward stopped while
        it broadcast buffers: this rank's next forward would broadcast again, the
        others' not; the others hear of it through the try's all-reduce, which
        ``tell_the_others`` makes before this rank raises.
        """
        if self.gradients:
            where = (
                f" This rank ran out of memory at batch size {size}; the other ranks may wait "
                "in that all-reduce until this process ends."
                if out_of_memory is not None
                else ""
            )
            msg = (
                "Cannot search with a step that synchronises the gradients of a "
                "DistributedDataParallel named in restore=: where one rank runs out of "
                "memory inside such a step and another does not, the other waits in its "
                "gradient all-reduce, and the process group hangs or aborts. Run the step "
                "on the wrapped module (ddp.module) or under ddp.no_sync(), keep "
                f"restore=(ddp, optimizer), and train with the wrapper as usual.{where}"
            )
            raise DeviceKitError(msg) from out_of_memory
        if self.broadcasting and out_of_memory is not None:
            tell_the_others()
            msg = (
                f"Cannot go on fitting the batch: the step ran out of memory at batch size "
                f"{size} inside the forward of a DistributedDataParallel that broadcasts its "
                "buffers, so this rank's next forward would broadcast them again and the "
                "other ranks' would not. Run the step on the wrapped module (ddp.module), "
                "or build the wrapper with forward_sync_buffers=False (broadcast_buffers=False "
                "in older PyTorch)."
            )
            raise DeviceKitError(msg) from out_of_memory

"""The stock copy path: host inputs are copied into per-device scratch right before their split.

At decode scale a MUL_MAT_ID split copies only the experts its routing ids use. From page-locked
memory the device copies them itself (``Stream.gather_h2d``), in stream order after the router
that wrote the ids: nothing waits for the host. From other memory (pageable, a staging ring),
or where the device cannot map host memory, the ids are read back (one host sync per distinct
ids buffer) and each run of consecutive experts is one copy (llama.cpp's behaviour).

A packed split (``MulMatId.packed``, gathered, fewer rows than experts) takes its experts one
after another instead of at their own offsets: its scratch holds a step's few experts, not the
whole tensor, and its kernels index them by the slot ids the gather writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from ..backends.base import BufferView, Device, DeviceBuffer, Stream, Usage, gathered_at_most
from ..errors import DeviceError, InvalidArgument, KernelCompileError, OutOfDeviceMemory
from .plan import Input, MulMatId, Prediction, Split
from .source import HostRegion, HostSource, StagedSource, enqueue_ranges
from .stats import DeviceStats, Fallback

log = logging.getLogger(__name__)


class StockCopier:
    """Scratch buffers of one device, one per input position, sized for the largest plan seen."""

    def __init__(self, device: Device, *, gather: bool = True) -> None:
        self.device = device
        self.gather = gather  # decode copies from page-locked memory made by the device (gather_h2d)
        self._scratch: list[DeviceBuffer] = []
        # The decode lookahead's scratch, by (layer parity, input name): a layer's predicted experts are
        # copied into it while the layer before computes from the other parity's.
        self._ahead: dict[tuple[int, str], DeviceBuffer] = {}
        self._ids_key: tuple[int, int] | None = None
        self._ids_read: np.ndarray = np.empty(0, dtype=np.int32)
        self._ids_used: np.ndarray = np.empty(0, dtype=np.int32)
        # Gathers report an id naming no expert here (int32 tag, id); a tag is an index into _gathered.
        self._report: DeviceBuffer | None = None
        self._gathered: list[tuple[str, int]] = []  # (split name, n_expert) of this run's gathers, by tag
        # Packed splits' slot ids, rewritten by each one in stream order (a layer's splits are adjacent).
        self._slots: DeviceBuffer | None = None
        self._slot_uploads: list[np.ndarray] = []  # host slot ids of packed copies made without a gather

    @property
    def device_bytes(self) -> int:
        """Device bytes of the scratch buffers (and the gathers' report word)."""
        small = sum(buf.alloc_size for buf in (self._report, self._slots) if buf is not None)
        ahead = sum(buf.alloc_size for buf in self._ahead.values())
        return sum(buf.alloc_size for buf in self._scratch) + ahead + small

    def reserve(self, sizes: list[int], stream: Stream, slot_ids: int = 0) -> None:
        """Make scratch ``k`` hold at least ``sizes[k]`` bytes, and the slot ids of packed splits
        ``slot_ids`` int32; called once per run, before any split."""
        if slot_ids and (self._slots is None or self._slots.alloc_size < 4 * slot_ids):
            if self._slots is not None:
                stream.synchronize()  # a pending kernel may still read the old ids
                self._slots.close()
                self._slots = None
            self._slots = self.device.alloc(4 * slot_ids, Usage.COMPUTE)
        self._slot_uploads.clear()
        for k, size in enumerate(sizes):
            held = self._scratch[k] if k < len(self._scratch) else None
            try:
                buf = self._regrown(held, size, stream)
            except BaseException:
                self._drop(k)  # never keep a closed buffer: the next run remakes them
                raise
            if held is None:
                self._scratch.append(buf)
            else:
                self._scratch[k] = buf
        self._ids_key = None
        self._gathered.clear()

    def _fitted(self, position: int, size: int, stream: Stream, room: Callable[[], bool] | None) -> DeviceBuffer:
        """Scratch ``position``, grown to ``size`` bytes where ``reserve`` left it smaller: a
        prefetched input's (sized for its slot) whose slot was lost mid-run. Growing waits for the
        compute stream; where the device has no room, ``room`` may free some (the lost prefetch's
        slots) once."""
        held: DeviceBuffer | None = self._scratch[position]
        assert held is not None
        if held.alloc_size >= size:
            return held
        try:
            try:
                held = self._regrown(held, size, stream)
            except OutOfDeviceMemory:
                if room is None or not room():
                    raise
                held = self._regrown(None, size, stream)  # the first try closed the old one
        except BaseException:
            self._drop(position)  # never kept closed: the next run's reserve remakes them
            raise
        self._scratch[position] = held
        return held

    def _drop(self, first: int) -> None:
        """Close scratch ``first`` and the ones after it (``first`` itself may be closed already)."""
        for buf in self._scratch[first:]:
            if not buf.closed:
                buf.close()
        del self._scratch[first:]

    def reserve_ahead(self, sizes: dict[tuple[int, str], int], stream: Stream) -> None:
        """Make the lookahead's scratch ``key`` hold at least ``sizes[key]`` bytes."""
        for key, size in sizes.items():
            held = self._ahead.pop(key, None)  # closed if it is regrown: never kept then
            self._ahead[key] = self._regrown(held, size, stream)

    def _regrown(self, held: DeviceBuffer | None, size: int, stream: Stream) -> DeviceBuffer:
        """``held`` where it holds ``size`` bytes, else a new buffer of them (``held`` closed first: it
        may be most of the free memory), zeroed once so that rows of experts a decode step does not
        copy hold defined bytes."""
        if held is not None and held.alloc_size >= size:
            return held
        stream.synchronize()  # a pending kernel may still read the old scratch
        if held is not None:
            held.close()
        buf = self.device.alloc(size, Usage.COMPUTE)
        stream.memset(buf, 0, size, 0)
        return buf

    def gather_ahead(
        self,
        stream: Stream,
        split: Split,
        inp: Input,
        parity: int,
        predicted: Prediction,
        stats: DeviceStats,
        packed: bool = False,
    ) -> bool:
        """Enqueue on ``stream`` the copy of the predicted experts of ``inp`` into the lookahead's
        scratch of ``parity`` (its first rows where ``packed``); False where the device cannot make
        it. An id naming no expert is not reported: predicted experts are only copied early, never
        computed."""
        dst = self._ahead[(parity, inp.name)]
        if not self._gather(stream, dst, split, inp, predicted.ids, predicted.n_ids, stats, packed=packed):
            return False
        stats.lookahead_gathers += 1
        stats.bytes_lookahead_at_most += _at_most(inp, predicted.n_ids, packed)
        return True

    def prepare_gathers(self) -> None:
        """Allocate what gathers report into now (a capture may not allocate)."""
        if self.gather and self._report is None:
            self._report = self.device.alloc(8, Usage.COMPUTE)

    def check_gathered_ids(self) -> None:
        """Once the run's stream is done: raise if a gather met a routing id that names no expert."""
        if not self._gathered or self._report is None or not self.device.backend.host.holds_data:
            return  # timing only: the simulated ids mean nothing
        tag, bad = (int(v) for v in self._report.read(0, 8).view(np.int32))
        if tag >= 0:
            name, n_expert = self._gathered[tag]
            raise InvalidArgument(
                f"split {name!r}: routing id {bad} is outside 0..{n_expert - 1}",
                hint="the router produced invalid expert ids; check n_expert and the ids buffer",
            )

    def copy(
        self,
        stream: Stream,
        split: Split,
        inp: Input,
        position: int,
        decode_routing: MulMatId | None,
        stats: DeviceStats,
        ahead: int | None = None,
        packed: bool = False,
        room: Callable[[], bool] | None = None,
    ) -> tuple[BufferView, BufferView | None]:
        """Enqueue the copy of ``inp`` into scratch ``position``; return what the kernels read, and
        the ids they index its experts by where those are not the routing ids (``packed``).

        ``ahead``: the parity of the lookahead scratch that ``gather_ahead`` filled with the
        decode routing's predicted experts (already waited for): the used experts go beside them,
        the predicted ones left out of the gather. ``packed``: the used experts go one after
        another (``packed_nbytes``), those of a lookahead after its predicted ones. ``room``: frees
        device memory where the scratch cannot grow (``_fitted``)."""
        assert inp.host is not None
        if packed:
            assert decode_routing is not None and inp.name in decode_routing.weights
            return self._copy_packed(stream, split, inp, position, decode_routing, stats, ahead, room)
        padded = inp.padded_nbytes
        dst = self._fitted(position, padded, stream, room)
        if decode_routing is not None and inp.name in decode_routing.weights:
            assert inp.expert_nbytes is not None
            skip = None
            if ahead is not None:
                dst, skip = self._ahead[(ahead, inp.name)], decode_routing.predicted
            gathered = self._gather(
                stream, dst, split, inp, decode_routing.ids, decode_routing.n_ids, stats, skip, decode_routing.n_expert
            )
            if gathered:
                stats.gathers += 1
                stats.bytes_gathered_at_most += _at_most(inp, decode_routing.n_ids)
            else:
                used = self._used_experts(stream, split, decode_routing, stats)
                ranges = expert_ranges(used, inp.expert_nbytes, inp.nbytes, padded - inp.nbytes)
                enqueue_ranges(inp.host, stream, dst, ranges)  # the used experts' copies, at once
                stats.bytes_stock += sum(end - start for start, end in ranges)
                stats.stock_copies += len(ranges)
        else:
            inp.host.enqueue_h2d(stream, dst, 0, 0, inp.nbytes)  # a whole-source copy, as announced
            stats.bytes_stock += inp.nbytes
            stats.stock_copies += 1
        if padded > inp.nbytes:
            # The scratch may have held a larger tensor: the tail kernels read must be zero again.
            stream.memset(dst, inp.nbytes, padded - inp.nbytes, 0)
        return dst.view(0, padded), None

    def _copy_packed(
        self,
        stream: Stream,
        split: Split,
        inp: Input,
        position: int,
        routing: MulMatId,
        stats: DeviceStats,
        ahead: int | None,
        room: Callable[[], bool] | None,
    ) -> tuple[BufferView, BufferView]:
        """``copy`` of a packed split: the used experts after the lookahead's predicted ones (or
        from the first row), their slot ids beside them."""
        assert self._slots is not None and inp.expert_nbytes is not None
        skip = routing.predicted if ahead is not None else None
        n_skip = 0 if skip is None else skip.n_ids
        rows = n_skip + routing.n_ids
        if ahead is None:
            dst = self._fitted(position, packed_nbytes(inp, rows), stream, room)
        else:
            dst = self._ahead[(ahead, inp.name)]
        slots = self._slots.view(0, 4 * routing.n_ids)
        if self._gather(
            stream, dst, split, inp, routing.ids, routing.n_ids, stats, skip, routing.n_expert, packed=True, slots=slots
        ):
            stats.gathers += 1
            stats.bytes_gathered_at_most += _at_most(inp, routing.n_ids, packed=True)
        else:
            self._packed_by_readback(stream, dst, split, inp, routing, n_skip, stats)
        tail = inp.padded_nbytes - inp.nbytes
        if tail:
            # Zero after the rows: the scratch may have held whole tensors or more rows before.
            stream.memset(dst, rows * inp.expert_nbytes, tail, 0)
        return dst.view(0, packed_nbytes(inp, rows)), slots

    def _packed_by_readback(
        self,
        stream: Stream,
        dst: DeviceBuffer,
        split: Split,
        inp: Input,
        routing: MulMatId,
        first_row: int,
        stats: DeviceStats,
    ) -> None:
        """A packed copy where the device does not gather: the ids read back, each used expert
        copied to the row its first position names (from ``first_row``, the predicted ones not
        told apart), and the slot ids sent after them."""
        assert self._slots is not None and inp.host is not None and inp.expert_nbytes is not None
        ids = self._routing_ids(stream, split, routing, stats)
        first_met = {int(e): j for j, e in reversed(list(enumerate(ids.tolist())))}
        slot_ids = np.array([first_row + first_met[int(e)] for e in ids], dtype=np.int32)
        size, overrun = inp.expert_nbytes, min(inp.padded_nbytes - inp.nbytes, inp.expert_nbytes)
        copied = set(first_met.values())
        with stream.device.backend.host.bare_calls():
            for expert, j in sorted(first_met.items(), key=lambda item: item[1]):
                inp.host.enqueue_h2d(stream, dst, (first_row + j) * size, expert * size, size)
            for j in range(len(ids)):  # as the gather: the bytes read past the row before an unwritten one
                if j not in copied and overrun:
                    stream.memset(dst, (first_row + j) * size, overrun, 0)
        stats.bytes_stock += len(first_met) * size
        stats.stock_copies += len(first_met)
        self._slot_uploads.append(slot_ids)  # kept until the next run: the copy may read it later
        stream.copy_h2d(self._slots, 0, self.device.wrap_host(slot_ids), 0, slot_ids.nbytes)

    def _gather(
        self,
        stream: Stream,
        dst: DeviceBuffer,
        split: Split,
        inp: Input,
        ids: BufferView,
        n_ids: int,
        stats: DeviceStats,
        skip: Prediction | None = None,
        reported_of: int | None = None,
        *,
        packed: bool = False,
        slots: BufferView | None = None,
    ) -> bool:
        """Enqueue the device's own copy of the experts that ``n_ids`` ``ids`` name (less those
        ``skip`` names), each with the bytes kernels read past its end (one after another, without
        them, where ``packed``); False where it cannot make one. ``reported_of``: the expert count
        an id must be below, an id beyond it reported."""
        assert inp.host is not None and inp.expert_nbytes is not None
        reported = reported_of is not None
        region = gather_region(inp.host)
        if not self.gather or region is None:
            return False
        try:
            self.prepare_gathers()
            assert self._report is not None
            if reported and not self._gathered:  # the run's first gather that reports
                stream.memset(self._report, 0, 8, 0xFF)  # -1: nothing reported
            stream.gather_h2d(
                dst,
                0,
                region.buffer,
                region.start,
                inp.nbytes,
                ids,
                n_ids,
                inp.expert_nbytes,
                inp.padded_nbytes - inp.nbytes,
                report=self._report.view() if reported else None,
                tag=len(self._gathered),
                skip=None if skip is None else skip.ids,
                n_skip=0 if skip is None else skip.n_ids,
                packed=packed,
                slots=slots,
            )
        except (DeviceError, KernelCompileError) as exc:
            # The device cannot read this memory (no mapping): read ids back from now on, and say so once.
            self.gather = False
            stats.fallbacks[Fallback.GATHER_FAILED] += 1
            log.warning(
                "%s: decode copies read routing ids back from now on; the device could not copy the experts itself: %s",
                self.device.label,
                exc,
            )
            return False
        if reported_of is not None:
            self._gathered.append((split.name, reported_of))
        return True

    def _used_experts(self, stream: Stream, split: Split, routing: MulMatId, stats: DeviceStats) -> np.ndarray:
        """The distinct experts the routing ids name, in order (read back once per ids buffer)."""
        self._routing_ids(stream, split, routing, stats)
        return self._ids_used

    def _routing_ids(self, stream: Stream, split: Split, routing: MulMatId, stats: DeviceStats) -> np.ndarray:
        """The routing ids, read back once per ids buffer and checked."""
        key = (id(routing.ids.buffer), routing.ids.offset)
        if key != self._ids_key:
            ids = np.empty(routing.n_ids, dtype=np.int32)
            stream.copy_d2h(self.device.wrap_host(ids), 0, routing.ids.buffer, routing.ids.offset, ids.nbytes)
            stream.synchronize()
            stats.ids_readbacks += 1
            # Timing only: the read-back cost is paid, its bytes mean nothing.
            if not self.device.backend.host.holds_data:
                if routing.stand_in_ids is None:
                    raise InvalidArgument(
                        f"split {split.name!r}: a backend without data cannot read routing ids back",
                        hint="give MulMatId stand_in_ids for timing-only runs",
                    )
                ids = routing.stand_in_ids.astype(np.int32, copy=False)
            bad = (ids < 0) | (ids >= routing.n_expert)
            if bad.any():
                raise InvalidArgument(
                    f"split {split.name!r}: routing id {int(ids[bad][0])} is outside 0..{routing.n_expert - 1}",
                    hint="the router produced invalid expert ids; check n_expert and the ids buffer",
                )
            self._ids_key = key
            self._ids_read = ids
            self._ids_used = np.unique(ids)
        return self._ids_read

    def close(self) -> None:
        """Free every buffer (callers wait for the work that reads them first); ``reserve`` and
        ``reserve_ahead`` make them again, and what this copier learnt (``gather``) stays."""
        for buf in [*self._scratch, *self._ahead.values()]:
            buf.close()
        self._scratch.clear()
        self._ahead.clear()
        for small in (self._report, self._slots):
            if small is not None:
                small.close()
        self._report = self._slots = None
        self._slot_uploads.clear()


def packed_nbytes(inp: Input, rows: int) -> int:
    """The bytes of ``rows`` of ``inp``'s experts one after another, and its padding tail."""
    assert inp.expert_nbytes is not None
    return rows * inp.expert_nbytes + inp.padded_nbytes - inp.nbytes


def _at_most(inp: Input, n_ids: int, packed: bool = False) -> int:
    """What a gather of ``n_ids`` of ``inp``'s experts copies if no two ids repeat."""
    assert inp.expert_nbytes is not None
    overrun = 0 if packed else inp.padded_nbytes - inp.nbytes
    return gathered_at_most(inp.nbytes, n_ids, inp.expert_nbytes, overrun)


def gather_region(source: HostSource) -> HostRegion | None:
    """The page-locked host region a device can copy ``source``'s experts from itself, if it is one."""
    if isinstance(source, HostRegion) and not isinstance(source, StagedSource) and source.buffer.is_page_locked:
        return source
    return None


def expert_ranges(used: np.ndarray, expert_nbytes: int, nbytes: int, overrun: int) -> list[tuple[int, int]]:
    """Byte ranges covering the used experts, one per run of consecutive experts.

    Kernels read up to ``overrun`` bytes past the end of a row, so a run that stops before
    the last expert also copies that many bytes of the next expert.
    """
    ranges: list[tuple[int, int]] = []
    if used.size == 0:
        return ranges
    breaks = np.flatnonzero(np.diff(used) != 1)
    starts = np.concatenate(([used[0]], used[breaks + 1]))
    ends = np.concatenate((used[breaks], [used[-1]]))
    for first, last in zip(starts.tolist(), ends.tolist(), strict=True):
        start = first * expert_nbytes
        end = (last + 1) * expert_nbytes
        ranges.append((start, min(end + overrun, nbytes)))
    return ranges

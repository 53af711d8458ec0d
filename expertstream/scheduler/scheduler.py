"""Run a plan of splits, copying host-resident weights ahead of need into prefetch slots when slots > 0."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field

from .._closing import Closing
from ..backends.base import BackendError, BufferView, Device, Event, Graph, Stream, Usage
from ..errors import InvalidArgument
from .plan import Input, MulMatId, Plan, Prediction, Split, expert_ids
from .prefetch import Milestone, PrefetchSlots, Unit, prefetch_footprint, slot_sizes
from .source import HostSource, Lookahead, LookaheadSource, expect_copies
from .stats import DeviceStats, Fallback, RunStats
from .stock import StockCopier, gather_region, packed_nbytes

log = logging.getLogger(__name__)

MAX_SLOTS = 8
DEFAULT_PREFILL_FACTOR = 2


def is_prefill_scale(n_ids: int, n_expert: int, prefill_factor: int = DEFAULT_PREFILL_FACTOR) -> bool:
    """Whether a MUL_MAT_ID split routing ``n_ids`` ids (tokens x top_k) over ``n_expert`` experts is prefill-scale.

    At prefill scale (``prefill_factor`` ids per expert or more) nearly every expert is used, so
    the scheduler copies whole expert tensors and may prefetch them; below it, a decode step,
    it copies only the experts the routing ids name.
    """
    return n_ids >= prefill_factor * n_expert


def device_footprint(
    slots: int,
    largest_input_bytes: int,
    *,
    host_inputs_per_split: int = 1,
    lookahead_inputs: int = 0,
    lookahead_bytes: int | None = None,
) -> int:
    """The most device bytes a ``Scheduler(slots=slots)`` allocates on one device for streamed inputs.

    Its prefetch slots (``prefetch_footprint``) and the stock copy's scratch: one buffer per host
    input of a split, allocated at the start where the input is not prefetched and grown where a
    prefetched input's slot is lost mid-run (a run whose prefetch works holds the slots alone).
    ``largest_input_bytes``: the largest padded size (``Input.padded_nbytes``) of the host inputs
    run on that device. Gathers (decode steps from page-locked memory) add the 8-byte word they
    report into and packed splits their slot ids. ``lookahead_inputs``: the expert tensors of a
    layer whose decode steps copy predicted experts ahead (``decode_lookahead``), each with a
    scratch buffer of ``lookahead_bytes`` (packed: a few experts; default the whole tensor) in
    each of two sets.
    """
    ahead = largest_input_bytes if lookahead_bytes is None else lookahead_bytes
    stock = host_inputs_per_split * largest_input_bytes + 2 * lookahead_inputs * ahead
    return prefetch_footprint(slots, largest_input_bytes) + stock


def check_slots(slots: int) -> int:
    if not isinstance(slots, int) or isinstance(slots, bool):
        raise TypeError(f"slots must be an int, got {type(slots).__name__}")
    if slots == 1:
        raise ValueError(
            "slots=1 cannot overlap a copy with compute and would overwrite the slot in use; use 0 or 2..8"
        )
    if not (slots == 0 or 2 <= slots <= MAX_SLOTS):
        raise ValueError(f"slots must be 0 (off) or 2..{MAX_SLOTS}, got {slots}")
    return slots


@dataclass
class _Ahead:
    """One layer's decode lookahead in a run: its predicted experts, copied on the device's side
    stream once the prediction's split ``after`` is launched, into the scratch of its ``parity``."""

    predicted: Prediction
    parity: int
    # the expert weights copied ahead, with the splits that read them and whether those are packed
    inputs: list[tuple[Split, Input, bool]]
    fork: Event | None = None  # recorded after split ``after``: the copies' start
    join: Event | None = None  # recorded after the copies: the splits wait on it
    forked: bool = False  # the side stream took the copies this run (the splits wait on ``join``)
    made: bool = False  # every copy went out: the splits read the lookahead's scratch


@dataclass
class _RunState:
    """Which inputs of which splits are prefetched in this run."""

    units: dict[int, list[Unit]]  # split index -> its units, in position order
    pending: dict[Device, list[Unit]]  # device -> its units in firing order
    blocks_host: dict[Device, bool]  # device -> some source may block the enqueuing thread
    released: dict[Device, int]  # device -> position of the last released unit
    next_fire: dict[Device, int]  # device -> index into pending of the next unit to fire
    lookaheads: list[Lookahead]  # told this run's whole-source copies; their lists end with the run
    # split index -> reached once that split is launched: its stock copies from a lookahead's sources
    # come before the prefetched copies of later splits in the announced order
    launched: dict[int, Milestone]
    ahead_after: dict[str, list[_Ahead]] = field(default_factory=dict)  # split name -> lookaheads it starts
    ahead_of: dict[int, _Ahead] = field(default_factory=dict)  # split index -> the lookahead it reads
    # split index -> the expert weights its decode copies pack (``_packs``)
    packed: dict[int, tuple[str, ...]] = field(default_factory=dict)


class Scheduler(Closing):
    """Runs plans on their devices' compute streams.

    ``slots=0`` is the stock path: no prefetch state, nothing allocated for it. ``slots`` in
    2..8 turns the lookahead on for host-resident expert weights at prefill scale.

    ``gather``: below prefill scale, the device copies the experts its routing ids use from
    page-locked host memory itself (``Stream.gather_h2d``), so a decode step never waits for the
    host; False reads the ids back and copies with DMA, as pageable memory and rings always do.

    ``decode_lookahead``: where a decode-scale split's routing carries a ``Prediction`` and the
    device gathers, its predicted experts are copied on a second stream of the device once the
    prediction's split ``after`` is launched, while the compute stream goes on (the layer's
    attention and router); the split then waits for them and gathers only the experts the
    prediction missed. Layers alternate between two scratch sets, so one layer's copies never
    overwrite what the layer before still reads. The outputs are the same bytes either way.
    """

    def __init__(
        self,
        *,
        slots: int = 0,
        prefill_factor: int = DEFAULT_PREFILL_FACTOR,
        streams: Mapping[Device, Stream] | None = None,
        gather: bool = True,
        decode_lookahead: bool = True,
    ) -> None:
        if prefill_factor < 1:
            raise ValueError(f"prefill_factor must be >= 1, got {prefill_factor}")
        self._slots = check_slots(slots)
        self.prefill_factor = prefill_factor
        self._streams: dict[Device, Stream] = dict(streams or {})
        self._owned_streams: list[Stream] = []
        self.gather = gather
        self.decode_lookahead = decode_lookahead
        self._side: dict[Device, Stream] = {}  # each device's stream for the decode lookahead's copies
        self._ahead_events: dict[Device, list[Event]] = {}  # fork and join events, two per lookahead
        self._stock: dict[Device, StockCopier] = {}
        self._prefetch: dict[Device, PrefetchSlots] = {}
        self._prefetch_off: set[Device] = set()  # devices whose prefetch failed; stock path until slots change
        self._told_too_many_inputs = False  # said once in the log; the stats count every time
        self.last_stats = RunStats()

    # -- configuration -------------------------------------------------------------------
    @property
    def slots(self) -> int:
        return self._slots

    @slots.setter
    def slots(self, slots: int) -> None:
        """Change the slot count between runs; what is no longer used is freed after a drain."""
        self._slots = check_slots(slots)
        for device, prefetch in list(self._prefetch.items()):
            prefetch.drain()
            self.stream(device).synchronize()  # kernels may still read a slot about to be freed
            if slots == 0:
                prefetch.close()
                del self._prefetch[device]
            else:
                prefetch.keep(slots)
        self._prefetch_off.clear()

    def release_scratch(self) -> None:
        """Free the prefetch slots and the stock copy's scratch of every device once the work that
        reads them is done; the next run allocates them again. Before a captured replay (which has
        scratch of its own) takes over a decode, so that the prompt's slots and the first step's
        scratch are not held beside it."""
        for device in {*self._prefetch, *self._stock}:
            self.stream(device).synchronize()  # kernels launched so far may read them
        for prefetch in self._prefetch.values():
            prefetch.drain()
            prefetch.keep(0)
        for copier in self._stock.values():
            copier.close()  # what it learnt (``gather``) stays; the next reserve remakes its buffers

    def device_bytes(self, device: Device | None = None) -> int:
        """Device bytes the scheduler holds for streamed inputs (prefetch slots and stock copy
        scratch) on ``device``, or on every device; a captured replay's own scratch is not counted."""
        held: list[tuple[Device, PrefetchSlots | StockCopier]] = [*self._prefetch.items(), *self._stock.items()]
        return sum(part.device_bytes for owner, part in held if device is None or owner is device)

    def stream(self, device: Device) -> Stream:
        """The compute stream of ``device`` (created on first use unless given)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = device.stream()
            self._streams[device] = stream
            self._owned_streams.append(stream)
        return stream

    def is_prefill_scale(self, routing: MulMatId) -> bool:
        """``is_prefill_scale`` at this scheduler's prefill factor."""
        return is_prefill_scale(routing.n_ids, routing.n_expert, self.prefill_factor)

    def _decode_routing(self, split: Split) -> MulMatId | None:
        """The routing of a MUL_MAT_ID split below prefill scale, whose weights are copied expert by expert."""
        routing = split.mul_mat_id
        return routing if routing is not None and not self.is_prefill_scale(routing) else None

    # -- running ---------------------------------------------------------------------------
    def run(self, plan: Plan) -> RunStats:
        """Enqueue every split in order and wait for the devices; returns what was done."""
        stats = RunStats()
        for device in plan.devices:
            stats.device(device.label)
        state = self._prepare(plan, stats)
        try:
            self._prepare_next(plan, 0, state, stats)
            for index, split in enumerate(plan.splits):
                self._launch(split, index, state, stats)
                self._prepare_next(plan, index + 1, state, stats)
        except BaseException:
            self._drain(plan, state, stats, failing=True)  # the original error is the one to see
            raise
        self._drain(plan, state, stats, failing=False)
        self.last_stats = stats
        return stats

    # -- capturing ---------------------------------------------------------------------------
    def why_not_captured(self, plan: Plan) -> str | None:
        """Why ``capture`` would refuse ``plan``, in a few words; None when it can capture it."""
        if len(plan.devices) != 1:
            return f"its splits run on {len(plan.devices)} devices"
        for split in plan.splits:
            if self._eligible_inputs(split):
                return f"split {split.name!r} reads its weights from prefetch slots"
            decode_routing = self._decode_routing(split)
            for inp in split.inputs:
                if inp.host is None:
                    continue
                if gather_region(inp.host) is None:
                    return f"split {split.name!r} copies {inp.name!r} from memory the device cannot read itself"
                if decode_routing is not None and inp.name in decode_routing.weights and not self.gather:
                    return "decode copies read routing ids back (gather=False)"
        return None

    def capture(self, plan: Plan, replan: Callable[[], Plan] | None = None) -> Replay:
        """``plan`` captured once into a graph, to run again with one launch (``Replay.run``).

        For plans whose every copy the device makes without the host: one device, host inputs
        in page-locked memory, no prefetch (a decode step of a model in registered or pinned
        memory). The replay has its own scratch; the plan's other buffers must stay open and in
        place while it lives. Raises InvalidArgument, saying why, for any other plan.

        ``replan``: the plan built again once the runtime has refused the decode lookahead's
        second stream and ``decode_lookahead`` is off, without the work that only predicts;
        without it, ``plan`` is captured again as it is.
        """
        reason = self.why_not_captured(plan)
        if reason is not None:
            raise InvalidArgument(f"this plan cannot be captured: {reason}", hint="run it with Scheduler.run")
        (device,) = plan.devices
        try:
            return self._capture(plan, device, RunStats())
        except BackendError as exc:
            predicted = any(s.mul_mat_id is not None and s.mul_mat_id.predicted is not None for s in plan.splits)
            if not (self.decode_lookahead and predicted):
                raise
            # The runtime refused the capture's second stream: capture without it, and say so once.
            self.decode_lookahead = False
            log.warning(
                "%s: decode steps copy each layer's experts after its router from now on; a step whose "
                "lookahead copies run on a second stream could not be captured: %s",
                device.label,
                exc,
            )
            stats = RunStats()
            stats.device(device.label).fallbacks[Fallback.LOOKAHEAD_FAILED] += 1
            return self._capture(plan if replan is None else replan(), device, stats)

    def _capture(self, plan: Plan, device: Device, stats: RunStats) -> Replay:
        stream = self.stream(device)
        stats.device(device.label)
        ours, self._stock = self._stock, {}  # the replay's scratch is its own: later runs may resize ours
        try:
            state = self._prepare(plan, stats)
            copier = self._stock.get(device)
            if copier is not None:
                copier.prepare_gathers()
            stream.synchronize()  # what _prepare enqueued (scratch zeroing) runs now, not in the graph
            stream.begin_capture()
            try:
                for index, split in enumerate(plan.splits):
                    self._launch(split, index, state, stats)
            except BaseException:
                with suppress(BackendError):
                    stream.end_capture(keep=False)
                raise
            graph = stream.end_capture()
        except BaseException:
            for copier_made in self._stock.values():
                copier_made.close()
            raise
        finally:
            self._stock = ours
        assert graph is not None
        return Replay(stream, graph, copier, stats)

    def _launch(self, split: Split, index: int, state: _RunState, stats: RunStats) -> None:
        device_stats = stats.device(split.device.label)
        stream = self.stream(split.device)
        units = {u.input.name: u for u in state.units.get(index, ()) if u.valid}
        decode_routing = self._decode_routing(split)
        ahead = state.ahead_of.get(index)
        if ahead is not None and ahead.forked:
            assert ahead.join is not None
            stream.wait(ahead.join)  # the predicted experts are in
        parity = ahead.parity if ahead is not None and ahead.made else None  # where the predicted experts are
        bindings: dict[str, BufferView] = {}
        host_position = 0
        packed = state.packed.get(index, ())
        room = functools.partial(self._room_from_lost_slots, split.device, units.values())
        for inp in split.inputs:
            if inp.device_data is not None:
                bindings[inp.name] = inp.device_data
                continue
            unit = units.get(inp.name)
            if unit is not None and unit.view is not None:
                bindings[inp.name] = unit.view
            else:
                copier = self._stock[split.device]
                bindings[inp.name], slot_ids = copier.copy(
                    stream,
                    split,
                    inp,
                    host_position,
                    decode_routing,
                    device_stats,
                    ahead=parity,
                    packed=inp.name in packed,
                    room=room,
                )
                if slot_ids is not None:
                    bindings[expert_ids(inp.name)] = slot_ids
            host_position += 1
        routing = split.mul_mat_id
        if routing is not None and routing.packed:
            for name in routing.weights:  # laid out whole: indexed by the routing ids
                bindings.setdefault(expert_ids(name), routing.ids)
        split.compute(stream, bindings)
        for started in state.ahead_after.get(split.name, ()):
            self._copy_ahead(split.device, started, device_stats)
        prefetch = self._prefetch.get(split.device)
        for unit in units.values():
            assert prefetch is not None
            prefetch.release(stream, unit)
            state.released[split.device] = unit.position
        milestone = state.launched.get(index)
        if milestone is not None:
            milestone.reach(split.device.backend.host.timestamp())

    def _room_from_lost_slots(self, device: Device, kept: Iterable[Unit]) -> bool:
        """Where ``device``'s prefetch turned itself off this run: free the slots no split reads any
        more (all but those of ``kept``, the units of the split launching now), so that the stock
        copies replacing the rest can grow their scratch. Every unit after the one whose slot could
        not be allocated is off, so the valid ones are this split's or were read already. False
        where nothing was freed."""
        prefetch = self._prefetch.get(device)
        if prefetch is None or not prefetch.disabled:
            return False
        self.stream(device).synchronize()  # kernels launched so far may read the slots
        prefetch.drain()
        return prefetch.free_buffers_but({unit.position for unit in kept}) > 0

    def _copy_ahead(self, device: Device, ahead: _Ahead, stats: DeviceStats) -> None:
        """Right after the prediction's split ``after`` is launched: copy ``ahead``'s experts on the side stream."""
        copier = self._stock[device]
        if not copier.gather:
            return  # the device stopped gathering this run (said once): the splits copy as without
        compute, side = self.stream(device), self._side_stream(device)
        assert ahead.fork is not None and ahead.join is not None
        compute.record(ahead.fork)
        side.wait(ahead.fork)  # after the ids are written, and after every earlier reader of this parity
        made = True
        for split, inp, packed in ahead.inputs:
            made = made and copier.gather_ahead(side, split, inp, ahead.parity, ahead.predicted, stats, packed)
        side.record(ahead.join)
        ahead.forked, ahead.made = True, made

    def _side_stream(self, device: Device) -> Stream:
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = device.stream()
        return side

    def _plan_ahead(self, plan: Plan, state: _RunState) -> dict[Device, dict[tuple[int, str], int]]:
        """The run's decode lookaheads (``decode_lookahead``); returns the scratch each device needs for them."""
        sizes: dict[Device, dict[tuple[int, str], int]] = {}
        if not self.decode_lookahead or not self.gather:
            return sizes
        by_key: dict[tuple[int, int], _Ahead] = {}
        for index, split in enumerate(plan.splits):
            routing = self._decode_routing(split)
            predicted = routing.predicted if routing is not None else None
            if routing is None or predicted is None:
                continue
            weights = [i for i in split.inputs if i.name in routing.weights and i.host is not None]
            if not weights or any(gather_region(i.host) is None for i in weights if i.host is not None):
                continue
            copier = self._stock.get(split.device)
            if copier is not None and not copier.gather:
                continue  # the device stopped gathering (said once): nothing would be copied ahead
            key = (id(predicted.ids.buffer), predicted.ids.offset)
            ahead = by_key.get(key)
            if ahead is None:
                ahead = by_key[key] = _Ahead(predicted, parity=len(by_key) % 2, inputs=[])
                state.ahead_after.setdefault(predicted.after, []).append(ahead)
            state.ahead_of[index] = ahead
            device_sizes = sizes.setdefault(split.device, {})
            packed = index in state.packed  # every weight of a packed split is among these
            for inp in weights:
                ahead.inputs.append((split, inp, packed))
                slot = (ahead.parity, inp.name)
                size = packed_nbytes(inp, predicted.n_ids + routing.n_ids) if packed else inp.padded_nbytes
                device_sizes[slot] = max(device_sizes.get(slot, 0), size)
        for device in sizes:
            self._side_stream(device)  # made now: a capture may follow
            aheads = [a for a in by_key.values() if a.inputs[0][0].device is device]
            events = self._ahead_events.setdefault(device, [])
            while len(events) < 2 * len(aheads):
                events.append(device.event())
            for n, ahead in enumerate(aheads):
                ahead.fork, ahead.join = events[2 * n], events[2 * n + 1]
        return sizes

    def _prepare_next(self, plan: Plan, index: int, state: _RunState, stats: RunStats) -> None:
        """Right after split index-1 is launched: wait for split index's slots, then fire ahead.

        The ordering rule, and why: the compute stream's wait for split j is enqueued after
        split j-1 is launched and after j's own copy is enqueued, with no other copy enqueued in
        between. A copy from pageable memory can hold the enqueuing thread until the copy is
        done (CUDA, and ROCm in stream order), and on ROCm a wait enqueued after such a copy
        resolves against the copy stream's tail; either way a wait enqueued after the next
        split's copy would let split j start only when that copy ends. Copies for split i+N-1
        go out while split i computes, each behind the free event of the slot it reuses.

        The rule is per device, and on several devices it holds for pageable copies only: the
        other devices' copies go out before split j's wait, as soon as their slots allow, so that
        devices copy at the same time instead of in turn. A device's pageable copies still wait
        for its own previous wait (the copy worker's gate); its page-locked ones may go out ahead
        of it, which costs nothing: they neither hold the thread nor move where a wait resolves.
        """
        if index >= len(plan.splits):
            return
        device = plan.splits[index].device
        units = [u for u in state.units.get(index, ()) if u.valid]
        if units:
            self._fire_through(self._prefetch[device], state, device, units[-1].position, stats.device(device.label))
        for other in state.pending:
            if other is not device:
                self._fire_ahead(other, state, stats)
        if not units:
            return
        if state.blocks_host[device]:
            # The copy worker holds each pageable copy until the wait before it is enqueued: hand
            # it the fills now, so that it has waited for their slots and cleared their tails by then.
            self._fire_ahead(device, state, stats)
        prefetch = self._prefetch[device]
        compute = self.stream(device)
        device_stats = stats.device(device.label)
        for unit in units:
            if unit.valid:
                unit.view = prefetch.consume(compute, unit, device_stats)
        self._fire_ahead(device, state, stats)

    def _fire_ahead(self, device: Device, state: _RunState, stats: RunStats) -> None:
        """Fire ``device``'s units as far ahead as its slots allow.

        A unit's slot is free for a fill once the split that last read it has been launched (the
        fill waits on the copy stream for its kernels). Copies enqueued here at once keep one
        slot for the split computing now: they stop N-1 past the last released unit. Copies
        the worker makes (rule 5) may take all N: a pageable one waits for the wait before it,
        a staged one for its fills, and both for their slot's free event on the copy stream.
        """
        prefetch = self._prefetch[device]
        depth = prefetch.n_slots if state.blocks_host[device] else prefetch.n_slots - 1
        self._fire_through(prefetch, state, device, state.released[device] + depth, stats.device(device.label))

    def _fire_through(
        self, prefetch: PrefetchSlots, state: _RunState, device: Device, position: int, stats: DeviceStats
    ) -> None:
        """Fire this device's units in order up to ``position``."""
        pending = state.pending[device]
        while (index := state.next_fire[device]) < len(pending) and pending[index].position <= position:
            previous = pending[index - 1] if index else None
            prefetch.fire(pending[index], stats, state.blocks_host[device], previous)
            state.next_fire[device] += 1

    # -- per-run setup and teardown ---------------------------------------------------------
    def _prepare(self, plan: Plan, stats: RunStats) -> _RunState:
        """Decide which inputs are prefetched, once per run, and size scratch and slots for them."""
        state = _RunState(units={}, pending={}, blocks_host={}, released={}, next_fire={}, lookaheads=[], launched={})
        # device -> the last split so far whose launch makes a whole copy from a lookahead's source
        stock_split: dict[Device, int] = {}
        scratch_sizes: dict[Device, list[int]] = {}
        slot_ids: dict[Device, int] = {}  # the most routing ids of a packed split, per device
        fired_bytes: dict[Device, list[int]] = {}  # each prefetched input's padded size, in firing order
        whole_copies: list[HostSource] = []  # in the order they are made, per device
        for index, split in enumerate(plan.splits):
            eligible = {inp.name for inp in self._prefetched_inputs(split, stats.device(split.device.label))}
            sizes = scratch_sizes.setdefault(split.device, [])
            decode_routing = self._decode_routing(split)
            earlier_stock = stock_split.get(split.device)
            packed: tuple[str, ...] = ()
            if self._packs(split):
                assert decode_routing is not None
                packed = state.packed[index] = decode_routing.weights
                slot_ids[split.device] = max(slot_ids.get(split.device, 0), decode_routing.n_ids)
            for position, inp in enumerate(i for i in split.inputs if i.is_host):
                assert inp.host is not None
                shared = isinstance(inp.host, LookaheadSource)
                if decode_routing is None or inp.name not in decode_routing.weights:
                    whole_copies.append(inp.host)  # a decode step copies only the experts its ids use
                    if shared and inp.name not in eligible:
                        stock_split[split.device] = index
                if inp.name in eligible:
                    pending = state.pending.setdefault(split.device, [])
                    unit = Unit(inp, position=len(pending))
                    if shared and earlier_stock is not None:
                        unit.after = state.launched.setdefault(earlier_stock, Milestone())
                    pending.append(unit)
                    state.units.setdefault(index, []).append(unit)
                    fired_bytes.setdefault(split.device, []).append(inp.padded_nbytes)
                    blocks = state.blocks_host.get(split.device, False)
                    state.blocks_host[split.device] = blocks or inp.host.blocks_host
                if position == len(sizes):
                    sizes.append(0)
                if inp.name in eligible:
                    continue  # its stock scratch is grown only where its slot is lost mid-run
                need = (
                    packed_nbytes(inp, decode_routing.n_ids)
                    if decode_routing and inp.name in packed
                    else inp.padded_nbytes
                )
                sizes[position] = max(sizes[position], need)
        for device, sizes in scratch_sizes.items():
            if sizes:
                copier = self._stock.setdefault(device, StockCopier(device, gather=self.gather))
                copier.reserve(sizes, self.stream(device), slot_ids.get(device, 0))
        for device, ahead_sizes in self._plan_ahead(plan, state).items():
            copier = self._stock[device]
            copier.reserve_ahead(ahead_sizes, self.stream(device))
            copier.prepare_gathers()
        for device, fired in fired_bytes.items():
            prefetch = self._prefetch_for(device)
            sizes = slot_sizes(self._slots, fired)
            if prefetch.grows(sizes):
                self.stream(device).synchronize()  # earlier kernels may still read the old slots
                prefetch.drain()
            prefetch.configure(sizes)
            prefetch.reset_run()
            state.released[device] = -1
            state.next_fire[device] = 0
        # Last, once nothing here can fail: the run's drain is what ends these lists.
        state.lookaheads = expect_copies(whole_copies)
        return state

    def _packs(self, split: Split) -> bool:
        """Whether ``split``'s decode copies go one after another (``MulMatId.packed``): every
        expert weight gathered from page-locked memory, into fewer rows than the tensor has."""
        routing = self._decode_routing(split)
        copier = self._stock.get(split.device)
        if routing is None or not routing.packed or not self.gather or (copier is not None and not copier.gather):
            return False
        weights = [i for i in split.inputs if i.name in routing.weights]
        if any(i.host is None or gather_region(i.host) is None for i in weights):
            return False
        ahead = routing.predicted.n_ids if routing.predicted is not None and self.decode_lookahead else 0
        return ahead + routing.n_ids < routing.n_expert

    def _prefetched_inputs(self, split: Split, stats: DeviceStats) -> list[Input]:
        """The inputs of ``split`` that are prefetched this run."""
        eligible = self._eligible_inputs(split)
        room = self._slots - 1  # one slot is always held by the split computing now
        if len(eligible) > room > 0:
            stats.fallbacks[Fallback.TOO_MANY_INPUTS] += len(eligible) - room
            if not self._told_too_many_inputs:
                self._told_too_many_inputs = True
                log.warning(
                    "split %s reads %d prefetchable inputs but %d prefetch slots leave room for %d: the rest take "
                    "the stock copy (counted as too_many_inputs; use at least %d slots)",
                    split.name,
                    len(eligible),
                    self._slots,
                    room,
                    len(eligible) + 1,
                )
            eligible = eligible[:room]
        if eligible and split.device in self._prefetch_off:
            stats.fallbacks[Fallback.DISABLED] += len(eligible)
            return []
        return eligible

    def _eligible_inputs(self, split: Split) -> list[Input]:
        routing = split.mul_mat_id
        if self._slots == 0 or routing is None or not self.is_prefill_scale(routing):
            return []
        return [i for i in split.inputs if i.is_host and i.name in routing.weights and i.usage is Usage.WEIGHTS]

    def _prefetch_for(self, device: Device) -> PrefetchSlots:
        prefetch = self._prefetch.get(device)
        if prefetch is None:
            prefetch = self._prefetch[device] = PrefetchSlots(device)
        return prefetch

    def _drain(self, plan: Plan, state: _RunState, stats: RunStats, *, failing: bool) -> None:
        """Wait for every device's copies and kernels; nothing may be freed before this."""
        errors: list[BaseException] = []
        if failing:
            _release_waiters(state)
        # Only the prefetch slots this run used have work in flight: a decode step leaves them alone.
        used = {device: self._prefetch[device] for device in plan.devices if device in state.pending}
        if not failing:
            # First, every device's, each as soon as its wait is over: reading the wait times then
            # overlaps the copies and kernels still running instead of following them.
            with _collected(errors):
                for device, slots in used.items():
                    stats.device(device.label).ready_wait_ms = slots.ready_wait_ms()
        for device in plan.devices:
            self._drain_device(device, used.get(device), errors, failing=failing)
        for lookahead in state.lookaheads:  # a failed run leaves copies it announced but never made
            with _collected(errors):
                lookahead.expect(())
        for extra in errors[0 if failing else 1 :]:
            log.error("while draining after an error: %s", extra)
        if errors and not failing:
            raise errors[0]

    def _drain_device(
        self, device: Device, prefetch: PrefetchSlots | None, errors: list[BaseException], *, failing: bool
    ) -> None:
        """One device's part of ``_drain``: its prefetch copies, then its stream; each error is kept."""
        with _collected(errors):
            if prefetch is not None:
                prefetch.drain()
        with _collected(errors):
            side = self._side.get(device)
            if side is not None:
                side.synchronize()  # the decode lookahead's copies (a failed run may not have waited for them)
            self.stream(device).synchronize()  # even if the prefetch failed: kernels may read slots
            if prefetch is not None and prefetch.disabled:  # nothing can use its slots any more
                prefetch.close()
                del self._prefetch[device]
                self._prefetch_off.add(device)
        copier = self._stock.get(device)
        if copier is not None and not failing:
            with _collected(errors):
                copier.check_gathered_ids()

    def close(self) -> None:
        """Release prefetch slots, scratch and owned streams, each after the work that uses it is done."""
        with ExitStack() as stack:
            for stream in self._owned_streams:
                stack.callback(stream.close)
            for events in self._ahead_events.values():
                for event in events:
                    stack.callback(event.close)
            for side in self._side.values():
                stack.callback(side.close)
            for copier in self._stock.values():
                stack.callback(copier.close)
            for prefetch in self._prefetch.values():
                stack.callback(prefetch.close)
            for stream in [*self._streams.values(), *self._side.values()]:
                stack.callback(stream.synchronize)  # runs first: kernels may still read slots and scratch
        self._prefetch.clear()
        self._side.clear()
        self._ahead_events.clear()
        self._stock.clear()
        self._owned_streams.clear()
        self._streams.clear()


class Replay(Closing):
    """A plan captured by ``Scheduler.capture``: ``run`` enqueues all of it with one graph launch.

    ``launch`` and ``finish`` split ``run`` in two, for work of the caller's own on the stream
    between them (copying a step's input in and its output out).
    """

    def __init__(self, stream: Stream, graph: Graph, copier: StockCopier | None, stats: RunStats) -> None:
        self.stream = stream
        self.graph = graph
        self._copier = copier
        self._stats = stats
        self.closed = False

    @property
    def device_bytes(self) -> int:
        """Device bytes of the replay's own scratch (``Scheduler.device_bytes`` does not count them)."""
        return 0 if self._copier is None or self.closed else self._copier.device_bytes

    def launch(self) -> None:
        """Enqueue the captured plan on the scheduler's stream of its device."""
        if self.closed:
            raise InvalidArgument("the replay is closed", call="Replay.launch")
        self.graph.launch(self.stream)

    def finish(self) -> RunStats:
        """Wait for the stream; raise as Scheduler.run does for a routing id naming no expert."""
        self.stream.synchronize()
        if self._copier is not None:
            self._copier.check_gathered_ids()
        return copy.deepcopy(self._stats)

    def run(self) -> RunStats:
        """The captured plan once more, as Scheduler.run would run it; returns what it did."""
        self.launch()
        return self.finish()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with ExitStack() as stack:
            if self._copier is not None:
                stack.callback(self._copier.close)
            stack.callback(self.graph.close)
            if not self.stream.closed:  # the scheduler may have closed it, after waiting for it
                stack.callback(self.stream.synchronize)  # runs first: a launch may still read the scratch


def _release_waiters(state: _RunState) -> None:
    """After an error: copies queued behind a consumer wait that will never come must not wait forever."""
    for units in state.pending.values():
        for unit in units:
            unit.waited.set()
    for milestone in state.launched.values():
        if not milestone.reached:
            milestone.reach(0.0)


@contextmanager
def _collected(errors: list[BaseException]) -> Iterator[None]:
    """Run the block; an exception it raises is appended to ``errors`` instead of stopping the drain."""
    try:
        yield
    except BaseException as exc:
        errors.append(exc)

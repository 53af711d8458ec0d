"""Which thread enqueues a copy, which bytes a decode step copies, and prefetch coming back after a failure."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from contextlib import ExitStack

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from expertstream.backends.base import Backend, BufferView, DeviceBuffer, HostMemory, Stream, Usage
from expertstream.errors import DeviceError, InvalidArgument, OutOfDeviceMemory
from expertstream.ggml import row_size
from expertstream.kernels import MoeKernels, reference
from expertstream.kernels.layout import MatrixPath
from expertstream.scheduler import Fallback, Input, MulMatId, Plan, Scheduler, Split, bound_experts, expert_ids
from expertstream.scheduler.source import HostRegion, HostSource
from expertstream.scheduler.stock import expert_ranges

from . import plans


class _ThreadRecordingSource:
    """A host source that notes which thread enqueues each of its copies."""

    def __init__(self, inner: HostSource, threads: list[threading.Thread]) -> None:
        self._inner = inner
        self._threads = threads

    @property
    def nbytes(self) -> int:
        return self._inner.nbytes

    @property
    def blocks_host(self) -> bool:
        return self._inner.blocks_host

    def enqueue_h2d(self, stream: Stream, dst: DeviceBuffer, dst_offset: int, offset: int, nbytes: int) -> None:
        self._threads.append(threading.current_thread())
        self._inner.enqueue_h2d(stream, dst, dst_offset, offset, nbytes)


def _recording(plan: Plan, threads: list[threading.Thread]) -> Plan:
    splits = []
    for split in plan.splits:
        inputs = tuple(
            dataclasses.replace(inp, host=_ThreadRecordingSource(inp.host, threads)) if inp.host is not None else inp
            for inp in split.inputs
        )
        splits.append(dataclasses.replace(split, inputs=inputs))
    return Plan.of(splits)


@pytest.mark.parametrize("host", [HostMemory.PAGEABLE, HostMemory.PINNED, HostMemory.REGISTERED])
def test_only_copies_that_can_block_leave_the_launching_thread(backend: Backend, host: HostMemory) -> None:
    built = plans.build(backend, plans.uniform_specs(6, host=host), seed=21)
    threads: list[threading.Thread] = []
    with Scheduler(slots=3) as sched:
        stats = sched.run(_recording(built.plan, threads))
    built.check()
    dev = stats.device(backend.device(0).label)
    assert dev.fires == dev.consumed == 6 and dev.stock_copies == 0
    assert len(threads) == 6
    launching = threading.current_thread()
    if host is HostMemory.PAGEABLE:
        # A pageable copy holds the thread that enqueues it until it is done: never the launcher.
        assert launching not in threads
        assert len(set(threads)) == 1, "one copy worker per device, in order"
        assert threads[0].name == f"expertstream-copy-{backend.device(0).label}"
        assert threads[0].daemon, "a scheduler left open must not keep the interpreter from exiting"
    else:
        assert threads == [launching] * 6
    built.close()


N_EXPERT, ROWS, NE0 = 4, 8, 96  # Q4_0 rows of 96: padded so that 512-wide reads stay inside


def _decode_splits(
    backend: Backend,
    ids: list[int],
    seen: dict[str, BufferView],
    *,
    layers: int = 1,
    qtype: Q = Q.Q4_0,
    host_kind: HostMemory = HostMemory.PAGEABLE,
    packed: bool = False,
    bound: dict[str, Mapping[str, BufferView]] | None = None,
) -> tuple[list[Split], np.ndarray, list]:
    """Decode-scale MUL_MAT_ID splits over 4 experts of 8 rows of 96, all routed by one ids buffer
    (``packed``: ``MulMatId.packed``; ``bound``: each split's bindings, kept)."""
    device = backend.device(0)
    expert_nbytes = ROWS * row_size(qtype, NE0)
    data = np.random.default_rng(5).integers(1, 256, N_EXPERT * expert_nbytes, dtype=np.uint8)
    host = plans.host_buffer(device, data, host_kind)
    ids_buf = device.upload(np.array(ids, dtype=np.int32))
    region = HostRegion(host, 0, data.nbytes)
    weights = Input("w", data.nbytes, host=region, row_type=qtype, ne0=NE0, expert_nbytes=expert_nbytes)
    routing = MulMatId(ids_buf.view(), len(ids), N_EXPERT, ("w",), packed=packed)
    splits = []
    for layer in range(layers):

        def compute(stream: Stream, bindings: Mapping[str, BufferView], *, name: str = f"layer{layer}") -> None:
            seen[name] = bindings["w"]
            if bound is not None:
                bound[name] = dict(bindings)

        splits.append(Split(f"layer{layer}", device, (weights,), compute, routing))
    return splits, data, [host, ids_buf]


@pytest.mark.parametrize(("ids", "runs"), [([1, 1], [(1, 1)]), ([2, 0], [(0, 0), (2, 2)]), ([1, 2], [(1, 2)])])
def test_decode_copies_the_bytes_kernels_read_past_each_used_run_of_experts(
    backend: Backend, ids: list[int], runs: list[tuple[int, int]]
) -> None:
    seen: dict[str, BufferView] = {}
    (split,), data, resources = _decode_splits(backend, ids, seen)
    weights = split.inputs[0]
    assert weights.expert_nbytes is not None
    expert, overrun = weights.expert_nbytes, weights.padded_nbytes - weights.nbytes
    assert 0 < overrun < expert
    with Scheduler(slots=0) as sched:
        stats = sched.run(Plan.of([split]))
        view = seen["layer0"]
        scratch = view.buffer.read(view.offset, view.nbytes)
    dev = stats.device(split.device.label)
    assert dev.stock_copies == len(runs)
    assert dev.bytes_stock == sum((last + 1 - first) * expert + overrun for first, last in runs)
    copied = np.zeros(scratch.size, dtype=bool)
    for first, last in runs:
        end = (last + 1) * expert + overrun  # the run's experts, then what a row read past the last one reaches
        assert np.array_equal(scratch[first * expert : end], data[first * expert : end]), (first, last)
        copied[first * expert : end] = True
    assert not scratch[~copied].any(), "experts not copied read as zeros (the scratch is zeroed when made)"
    for resource in resources:
        resource.close()


@pytest.mark.parametrize("host_kind", [HostMemory.PINNED, HostMemory.REGISTERED])
@pytest.mark.parametrize("ids", [[1, 1], [2, 0], [1, 2], [3, 0, 3]])
def test_decode_gathers_each_used_expert_and_the_bytes_kernels_read_past_it(
    backend: Backend, ids: list[int], host_kind: HostMemory
) -> None:
    seen: dict[str, BufferView] = {}
    (split,), data, resources = _decode_splits(backend, ids, seen, host_kind=host_kind)
    weights = split.inputs[0]
    assert weights.expert_nbytes is not None
    expert, overrun = weights.expert_nbytes, weights.padded_nbytes - weights.nbytes
    with Scheduler(slots=0) as sched:
        stats = sched.run(Plan.of([split]))
        view = seen["layer0"]
        scratch = view.buffer.read(view.offset, view.nbytes)
    dev = stats.device(split.device.label)
    assert (dev.gathers, dev.ids_readbacks, dev.stock_copies, dev.bytes_stock) == (1, 0, 0, 0)
    assert dev.bytes_gathered_at_most == len(ids) * (expert + overrun)
    copied = np.zeros(scratch.size, dtype=bool)
    for used in set(ids):
        start, end = used * expert, min((used + 1) * expert + overrun, data.size)
        assert np.array_equal(scratch[start:end], data[start:end]), used
        copied[start:end] = True
    assert not scratch[~copied].any(), "experts not copied read as zeros (the scratch is zeroed when made)"
    for resource in resources:
        resource.close()


def test_a_gathered_id_outside_the_experts_is_named_once_the_run_is_done(backend: Backend) -> None:
    seen: dict[str, BufferView] = {}
    splits, data, resources = _decode_splits(backend, [3, -1, 7, 3], seen, layers=2, host_kind=HostMemory.PINNED)
    with Scheduler() as sched:
        with pytest.raises(InvalidArgument) as err:
            sched.run(Plan.of(splits))
        assert err.value.detail in (f"split 'layer0': routing id {bad} is outside 0..3" for bad in (-1, 7))
        assert err.value.hint == "the router produced invalid expert ids; check n_expert and the ids buffer"
        view = seen["layer1"]
        scratch = view.buffer.read(view.offset, view.nbytes)
        expert = splits[0].inputs[0].expert_nbytes
        assert expert is not None
        assert np.array_equal(scratch[3 * expert :][: data.size - 3 * expert], data[3 * expert :]), "valid ids copied"
        ids_buf = resources[1]
        ids_buf.write(np.array([0, 1, 2, 3], dtype=np.int32))
        stats = sched.run(Plan.of(splits))  # the next run starts with nothing reported
    assert stats.device(splits[0].device.label).gathers == 2
    for resource in resources:
        resource.close()


def test_splits_sharing_routing_ids_read_them_back_once(backend: Backend) -> None:
    seen: dict[str, BufferView] = {}
    splits, _data, resources = _decode_splits(backend, [3, 3], seen, layers=3)
    with Scheduler(slots=0) as sched:
        stats = sched.run(Plan.of(splits))
        again = sched.run(Plan.of(splits[:1]))  # a new run reads them again: the device may have rewritten them
    assert stats.device(splits[0].device.label).ids_readbacks == 1
    assert again.device(splits[0].device.label).ids_readbacks == 1
    for resource in resources:
        resource.close()


@pytest.mark.parametrize(("ids", "named"), [([4, 99], 4), ([-1, 0], -1), ([2, 7], 7)])
def test_an_expert_id_outside_the_experts_is_named(backend: Backend, ids: list[int], named: int) -> None:
    (split,), _data, resources = _decode_splits(backend, ids, {})
    with Scheduler() as sched, pytest.raises(InvalidArgument) as err:
        sched.run(Plan.of([split]))
    assert err.value.detail == f"split 'layer0': routing id {named} is outside 0..3"
    assert err.value.hint == "the router produced invalid expert ids; check n_expert and the ids buffer"
    for resource in resources:
        resource.close()


def test_rows_that_need_no_padding_get_no_tail_clearing(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    (split,), data, resources = _decode_splits(backend, [0, 2], {}, qtype=Q.F16)
    assert split.inputs[0].padded_nbytes == split.inputs[0].nbytes
    sizes: list[int] = []
    stream_type = type(backend.device(0).stream())
    real_memset = stream_type.memset

    def counting_memset(self, dst, offset, nbytes, value=0):  # type: ignore[no-untyped-def]
        sizes.append(nbytes)
        real_memset(self, dst, offset, nbytes, value)

    monkeypatch.setattr(stream_type, "memset", counting_memset)
    with Scheduler(slots=0) as sched:
        sched.run(Plan.of([split]))
    assert sizes == [data.nbytes], "only the scratch's one zeroing; no empty tail to clear"
    for resource in resources:
        resource.close()


@pytest.mark.parametrize(
    ("used", "ranges"),
    [
        ([], []),
        ([2], [(20, 33)]),
        ([0, 1, 3, 5, 6], [(0, 23), (30, 43), (50, 70)]),
        ([6], [(60, 70)]),  # the last expert: the tensor's own padding follows, cleared separately
        ([0, 2, 4], [(0, 13), (20, 33), (40, 53)]),
    ],
)
def test_expert_ranges_cover_each_run_and_what_rows_read_past_it(
    used: list[int], ranges: list[tuple[int, int]]
) -> None:
    assert expert_ranges(np.array(used, dtype=np.int32), 10, 70, 3) == ranges


def test_prefetch_returns_after_a_failed_allocation_once_the_slot_count_changes(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = backend.device(0)
    built = plans.build(backend, plans.uniform_specs(6), seed=22)
    with Scheduler(slots=3) as sched:
        sched.slots = 0
        sched.run(built.plan)  # scratch exists now: every later allocation is a prefetch slot
        sched.slots = 3
        real_alloc = device.alloc
        made: list[DeviceBuffer] = []

        def second_slot_fails(n, *args, **kwargs):  # type: ignore[no-untyped-def]
            if len(made) == 1:
                raise OutOfDeviceMemory(f"cannot allocate {n} bytes", call="alloc", device=device.label)
            made.append(real_alloc(n, *args, **kwargs))
            return made[-1]

        monkeypatch.setattr(device, "alloc", second_slot_fails)
        failed = sched.run(built.plan)
        built.check()
        assert failed.device(device.label).fallbacks[Fallback.ALLOC_FAILED] == 1
        assert made[0].closed, "the turned-off ring's slot is freed once the run has drained"
        monkeypatch.setattr(device, "alloc", real_alloc)
        sched.slots = 2
        again = sched.run(built.plan)
        built.check()
    dev = again.device(device.label)
    assert dev.fires == dev.consumed == 6
    assert dev.fallbacks[Fallback.DISABLED] == 0 and dev.stock_copies == 0
    built.close()


def _split_with_inputs(backend: Backend, sizes: list[int], resources: list) -> Split:
    """One split whose host inputs (one per scratch position) have the given sizes."""
    device = backend.device(0)
    inputs = []
    for position, size in enumerate(sizes):
        host = device.wrap_host(np.full(size, position + 1, dtype=np.uint8))
        resources.append(host)
        inputs.append(Input(f"in{position}", size, host=HostRegion(host, 0, size)))
    return Split("s", device, tuple(inputs), lambda stream, bindings: None)


def test_scratch_grows_per_position_and_a_failed_growth_leaves_nothing_stale(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = backend.device(0)
    resources: list = []
    with Scheduler(slots=0) as sched:
        stats = sched.run(Plan.of([_split_with_inputs(backend, [100, 10, 10], resources)]))
        assert list(stats.devices) == [device.label] and stats.device(device.label).device == device.label
        scratch = list(sched._stock[device]._scratch)
        assert [buf.usage for buf in scratch] == [Usage.COMPUTE] * 3  # garbage until written
        sched.run(Plan.of([_split_with_inputs(backend, [50, 100, 10], resources)]))  # only position 1 grows
        assert scratch[1].closed and not scratch[0].closed and not scratch[2].closed
        scratch = list(sched._stock[device]._scratch)
        real_alloc = device.alloc

        def no_room(n, *args, **kwargs):  # type: ignore[no-untyped-def]
            if n > 200:
                raise OutOfDeviceMemory(f"cannot allocate {n} bytes", call="alloc", device=device.label)
            return real_alloc(n, *args, **kwargs)

        monkeypatch.setattr(device, "alloc", no_room)
        with pytest.raises(OutOfDeviceMemory):
            sched.run(Plan.of([_split_with_inputs(backend, [300, 10, 10], resources)]))
        assert all(buf.closed for buf in scratch), "the grown position and the ones after it are dropped"
        monkeypatch.setattr(device, "alloc", real_alloc)
        sched.run(Plan.of([_split_with_inputs(backend, [300, 100, 10], resources)]))  # remade from scratch
        remade = sched._stock[device]._scratch
        assert all(b.alloc_size >= n and not b.closed for b, n in zip(remade, [300, 100, 10], strict=True))
    for resource in resources:
        resource.close()


def test_a_device_without_host_inputs_still_has_its_stats(backend: Backend) -> None:
    device = backend.device(0)
    buf = device.alloc(16)
    split = Split("resident", device, (Input("x", 16, device_data=buf.view()),), lambda stream, bindings: None)
    with Scheduler(slots=3) as sched:
        stats = sched.run(Plan.of([split]))
    assert list(stats.devices) == [device.label]
    assert stats.as_dict()[device.label]["device"] == device.label
    buf.close()


def test_device_and_host_inputs_of_one_split_each_get_their_own_bytes(backend: Backend) -> None:
    device = backend.device(0)
    resources: list = []
    resident = device.upload(np.arange(16, dtype=np.uint8))
    host_split = _split_with_inputs(backend, [40, 24, 8], resources)
    seen: dict[str, BufferView] = {}

    def compute(stream: Stream, bindings: Mapping[str, BufferView]) -> None:
        seen.update(bindings)

    inputs = (host_split.inputs[0], Input("resident", 16, device_data=resident.view()), *host_split.inputs[1:])
    split = Split("mixed", device, inputs, compute)
    with Scheduler(slots=0) as sched:
        sched.run(Plan.of([split]))
        got = {name: view.buffer.read(view.offset, view.nbytes) for name, view in seen.items()}
    assert sorted(got) == ["in0", "in1", "in2", "resident"]
    assert seen["resident"].buffer is resident
    for position, size in enumerate([40, 24, 8]):
        assert got[f"in{position}"].tolist() == [position + 1] * size
    resident.close()
    for resource in resources:
        resource.close()


@pytest.mark.parametrize("gathers", [True, False], ids=["gathered", "read-back"])
@pytest.mark.parametrize("ids", [[2, 0], [3, 3], [1, 0, 1]])
def test_a_packed_split_binds_the_used_experts_one_after_another_and_their_slot_ids(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, ids: list[int], gathers: bool
) -> None:
    device = backend.device(0)
    seen: dict[str, BufferView] = {}
    bound: dict[str, Mapping[str, BufferView]] = {}
    (split,), data, resources = _decode_splits(
        backend, ids, seen, host_kind=HostMemory.PINNED, packed=True, bound=bound
    )
    weights = split.inputs[0]
    assert weights.expert_nbytes is not None
    expert, tail = weights.expert_nbytes, weights.padded_nbytes - weights.nbytes
    if not gathers:  # the device cannot gather (found at the copy): the ids are read back, still packed

        def unmapped(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise DeviceError("pinned host memory is not mapped for this device", call="gather", device=device.label)

        monkeypatch.setattr(type(device.stream()), "gather_h2d", unmapped)
    with Scheduler(slots=0) as sched:
        stats = sched.run(Plan.of([split]))
        view, slot_view = seen["layer0"], bound["layer0"][expert_ids("w")]
        scratch = view.buffer.read(view.offset, view.nbytes)
        slots = slot_view.buffer.read(slot_view.offset, slot_view.nbytes).view(np.int32)
        held = sched.device_bytes()
    assert view.nbytes == len(ids) * expert + tail, "the scratch holds a step's experts, then the padding tail"
    assert bound_experts(view, expert, tail) == len(ids)
    first = {e: ids.index(e) for e in ids}
    assert slots.tolist() == [first[e] for e in ids], "each id's expert is at the row of its first position"
    for e, row in first.items():
        assert np.array_equal(scratch[row * expert : (row + 1) * expert], data[e * expert : (e + 1) * expert]), e
    assert not scratch[len(ids) * expert :].any(), "the padding tail reads as zeros"
    assert held < data.nbytes, "less than the whole tensor's scratch"
    dev = stats.device(device.label)
    if gathers:
        assert (dev.gathers, dev.ids_readbacks, dev.bytes_gathered_at_most) == (1, 0, len(ids) * expert)
    else:
        assert dev.fallbacks[Fallback.GATHER_FAILED] == 1 and (dev.gathers, dev.ids_readbacks) == (0, 1)
        assert dev.bytes_stock == len(first) * expert
    for resource in resources:
        resource.close()


@pytest.mark.parametrize(("ids", "host_kind"), [([0, 1, 2, 3], HostMemory.PINNED), ([2, 0], HostMemory.PAGEABLE)])
def test_a_packed_split_binds_whole_tensors_and_the_routing_ids_where_packing_saves_nothing(
    backend: Backend, ids: list[int], host_kind: HostMemory
) -> None:
    """As many ids as experts (no smaller scratch), or memory the device cannot gather from."""
    seen: dict[str, BufferView] = {}
    bound: dict[str, Mapping[str, BufferView]] = {}
    (split,), _data, resources = _decode_splits(backend, ids, seen, host_kind=host_kind, packed=True, bound=bound)
    assert split.mul_mat_id is not None
    with Scheduler(slots=0) as sched:
        sched.run(Plan.of([split]))
    assert seen["layer0"].nbytes == split.inputs[0].padded_nbytes
    assert bound["layer0"][expert_ids("w")] == split.mul_mat_id.ids
    for resource in resources:
        resource.close()


@pytest.mark.parametrize("gathers", [True, False], ids=["gathered", "read-back"])
def test_a_packed_split_reads_zeros_past_an_expert_whose_next_row_nothing_was_copied_to(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, gathers: bool
) -> None:
    """Kernels read past an expert's last row into the next one: packed, that is another expert's, or a
    row no expert went to (a repeated id's), which held what the scratch held before (here 0xFF bytes of
    an earlier split: NaN scales). The copies zero what is read there, so the outputs are the bytes of
    whole-tensor scratch."""
    device = backend.device(0)
    if not gathers:

        def unmapped(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise DeviceError("pinned host memory is not mapped for this device", call="gather", device=device.label)

        monkeypatch.setattr(type(device.stream()), "gather_h2d", unmapped)
    with MoeKernels(device, MatrixPath.SIMT) as kernels:
        packed, whole = (_experts_after_junk(kernels, packed) for packed in (True, False))
    assert np.isfinite(packed).all()
    assert packed.tobytes() == whole.tobytes()


def _experts_after_junk(kernels: MoeKernels, packed: bool) -> np.ndarray:
    """Three rows through Q4_0 experts of rows of 768 (read past their ends), ids 1, 1, 0, after a split
    that copied 0xFF bytes into the same stock scratch."""
    n_out, ne0, qtype = 20, 768, Q.Q4_0
    expert = n_out * row_size(qtype, ne0)
    rng = np.random.default_rng(3)
    weights = reference.random_weights(rng, qtype, N_EXPERT * n_out, ne0).view(np.uint8).reshape(-1)
    device = kernels.device
    with ExitStack() as stack:
        host = stack.enter_context(plans.host_buffer(device, weights, HostMemory.PINNED))
        junk = stack.enter_context(plans.host_buffer(device, np.full(4 * expert, 0xFF, np.uint8), HostMemory.PINNED))
        ids = stack.enter_context(device.upload(np.array([1, 1, 0], np.int32)))
        x = stack.enter_context(device.upload(rng.standard_normal((3, ne0)).astype(np.float32)))
        y = stack.enter_context(device.alloc(3 * n_out * 4))
        w = Input("w", weights.nbytes, host=HostRegion(host, 0, weights.nbytes), row_type=qtype, ne0=ne0,
                  expert_nbytes=expert)  # fmt: skip

        def compute(stream: Stream, bindings: Mapping[str, BufferView]) -> None:
            view, slot_ids = bindings["w"], bindings.get(expert_ids("w"), ids.view())
            n = bound_experts(view, expert, w.padded_nbytes - w.nbytes)
            kernels.mul_mat_id(stream, view, qtype, n, n_out, ne0, x.view(), False, slot_ids, 3, 1, y.view())

        earlier = Input("junk", 4 * expert, host=HostRegion(junk, 0, 4 * expert))
        splits = [
            Split("earlier", device, (earlier,), lambda stream, bindings: None),
            Split("experts", device, (w,), compute, MulMatId(ids.view(), 3, N_EXPERT, ("w",), packed=packed)),
        ]
        with Scheduler(slots=0) as sched:
            sched.run(Plan.of(splits))
        return y.read().view(np.float32).reshape(3, n_out).copy()


def test_a_packed_splits_other_host_inputs_are_copied_whole(backend: Backend) -> None:
    seen: dict[str, BufferView] = {}
    bound: dict[str, Mapping[str, BufferView]] = {}
    (split,), _data, resources = _decode_splits(
        backend, [2, 0], seen, host_kind=HostMemory.PINNED, packed=True, bound=bound
    )
    other = np.arange(256, dtype=np.uint8)
    host = plans.host_buffer(backend.device(0), other, HostMemory.PINNED)
    split = dataclasses.replace(split, inputs=(*split.inputs, Input("b", 256, host=HostRegion(host, 0, 256))))
    with Scheduler(slots=0) as sched:
        sched.run(Plan.of([split]))
        b = bound["layer0"]["b"]
        assert b.buffer.read(b.offset, b.nbytes).tobytes() == other.tobytes()
    assert expert_ids("b") not in bound["layer0"] and bound_experts(seen["layer0"], *_expert_and_tail(split)) == 2
    for resource in (*resources, host):
        resource.close()


def _expert_and_tail(split: Split) -> tuple[int, int]:
    weights = split.inputs[0]
    assert weights.expert_nbytes is not None
    return weights.expert_nbytes, weights.padded_nbytes - weights.nbytes

"""Scheduler.capture: a plan whose copies the device makes itself, captured once and replayed."""

from __future__ import annotations

import numpy as np
import pytest

from expertstream.backends.base import Backend, HostMemory
from expertstream.errors import InvalidArgument, UseAfterClose
from expertstream.scheduler import Plan, Scheduler

from . import digest, plans


@pytest.mark.parametrize("host", [HostMemory.PINNED, HostMemory.REGISTERED])
def test_a_replay_reads_the_current_experts_and_ids_each_time(backend: Backend, host: HostMemory) -> None:
    built = plans.build(backend, plans.uniform_specs(4, prefill=False, host=host), seed=31)
    rng = np.random.default_rng(32)
    with Scheduler(slots=3) as sched:
        ran = sched.run(built.plan)
        built.check()
        with sched.capture(built.plan) as replay:
            for buf, _ in built.outputs:
                buf.write(np.zeros(buf.nbytes, dtype=np.uint8))
            stats = replay.run()
            built.check()  # the same digests as the run
            assert stats.as_dict() == ran.as_dict()
            # New expert bytes and new ids: the next launch copies and reads those, not the captured ones.
            for index, split in enumerate(built.plan.splits):
                (inp,) = split.inputs
                routing = split.mul_mat_id
                assert inp.host is not None and routing is not None and inp.expert_nbytes is not None
                data = rng.integers(0, 256, inp.nbytes, dtype=np.uint8)
                ids = rng.integers(0, routing.n_expert, routing.n_ids, dtype=np.int32)
                inp.host.buffer.numpy(inp.host.start, inp.nbytes, write=True)[:] = data
                routing.ids.buffer.write(ids, routing.ids.offset)
                padded = inp.padded_nbytes
                expected = digest.reference(data, ids, routing.n_expert, inp.expert_nbytes, padded)
                built.outputs[index] = (built.outputs[index][0], expected)
            replay.run()
            built.check()
    built.close()


def test_a_replay_names_a_routing_id_outside_the_experts(backend: Backend) -> None:
    built = plans.build(backend, plans.uniform_specs(2, prefill=False), seed=33)
    with Scheduler() as sched, sched.capture(built.plan) as replay:
        replay.run()
        routing = built.plan.splits[1].mul_mat_id
        assert routing is not None
        routing.ids.buffer.write(np.full(routing.n_ids, 9, dtype=np.int32), routing.ids.offset)
        with pytest.raises(InvalidArgument, match=r"split 'layer1': routing id 9 is outside 0..3"):
            replay.run()
    built.close()


@pytest.mark.parametrize(
    ("specs", "slots", "gather", "reason"),
    [
        (plans.uniform_specs(2, prefill=False, host=HostMemory.PAGEABLE), 0, True, "memory the device cannot read"),
        (plans.uniform_specs(2, prefill=False), 0, False, "read routing ids back"),
        (plans.uniform_specs(2), 3, True, "reads its weights from prefetch slots"),
    ],
)
def test_what_cannot_be_captured_is_refused_with_the_reason(
    backend: Backend, specs: list[plans.LayerSpec], slots: int, gather: bool, reason: str
) -> None:
    built = plans.build(backend, specs, seed=34)
    with Scheduler(slots=slots, gather=gather) as sched:
        why = sched.why_not_captured(built.plan)
        assert why is not None and reason in why
        with pytest.raises(InvalidArgument, match=f"cannot be captured: .*{reason}"):
            sched.capture(built.plan)
        sched.run(built.plan)  # the scheduler is as it was
        built.check()
    built.close()


def test_prefill_scale_copies_from_page_locked_memory_are_captured_without_slots(backend: Backend) -> None:
    built = plans.build(backend, plans.uniform_specs(3), seed=35)
    with Scheduler(slots=0) as sched:
        assert sched.why_not_captured(built.plan) is None
        with sched.capture(Plan.of(built.plan.splits)) as replay:
            stats = replay.run()
        assert stats.total("stock_copies") == 3
    built.check()
    built.close()


def test_a_replay_outliving_its_scheduler_closes_quietly_and_refuses_to_run(backend: Backend) -> None:
    built = plans.build(backend, plans.uniform_specs(2, prefill=False), seed=36)
    with Scheduler() as sched:
        replay = sched.capture(built.plan)
    with pytest.raises(UseAfterClose):
        replay.run()  # the scheduler's stream is gone
    replay.close()
    with pytest.raises(InvalidArgument, match="replay is closed"):
        replay.launch()
    built.close()

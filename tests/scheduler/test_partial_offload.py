"""Plans where only some splits read host-resident weights (partial offload), under the hazard checker."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import expertstream
from expertstream.scheduler import Scheduler

from . import plans

N_LAYERS = 8


def _specs(n_streamed: int) -> list[plans.LayerSpec]:
    """The first ``n_streamed`` layers in pinned host memory, the others device-resident."""
    return [dataclasses.replace(s, resident=i >= n_streamed) for i, s in enumerate(plans.uniform_specs(N_LAYERS))]


def test_outputs_are_byte_identical_for_all_half_and_no_streamed_layers() -> None:
    outputs = {}
    with expertstream.backend("sim") as backend:
        for n_streamed in (N_LAYERS, N_LAYERS // 2, 0):
            built = plans.build(backend, _specs(n_streamed), seed=11)
            streamed = [s for s in built.plan.splits if s.inputs[0].is_host]
            assert len(streamed) == n_streamed
            for slots in (0, 3):
                with Scheduler(slots=slots) as sched:
                    stats = sched.run(built.plan)
                    built.check()
                    host_bytes = sum(s.inputs[0].nbytes for s in streamed)
                    assert stats.total("bytes_prefetched") + stats.total("bytes_stock") == host_bytes
                    assert stats.total("fires") == (n_streamed if slots else 0)
                    assert stats.total("consumed") == (n_streamed if slots else 0)
                    if slots == 0 or n_streamed == 0:
                        assert not sched._prefetch, "nothing to prefetch: no ring, no slots"
                outputs[(n_streamed, slots)] = built.read_outputs()
            built.close()
    reference = outputs[(N_LAYERS, 0)]
    for key, got in outputs.items():
        assert all(np.array_equal(a, b) for a, b in zip(got, reference, strict=True)), key


@pytest.mark.parametrize("slots", [2, 3, 8])
def test_slot_size_follows_the_largest_streamed_tensor_only(slots: int) -> None:
    with expertstream.backend("sim") as backend:
        device = backend.device(0)
        specs = plans.uniform_specs(N_LAYERS)
        sizes = [
            device.alloc_size(s.n_expert * s.rows * plans.row_size(s.row_type, s.ne0), s.row_type, s.ne0) for s in specs
        ]
        # Keep the largest tensors on the device: the slots must be sized by the streamed ones.
        mixed = [dataclasses.replace(s, resident=size == max(sizes)) for s, size in zip(specs, sizes, strict=True)]
        built = plans.build(backend, mixed, seed=12)
        with Scheduler(slots=slots) as sched:
            sched.run(built.plan)
            built.check()
            streamed_max = max(size for size in sizes if size != max(sizes))
            assert sched._prefetch[device].slot_bytes == streamed_max
        built.close()

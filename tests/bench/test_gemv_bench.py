"""microbench/kernels_gemv.py on the simulator: what its plain-copy reference counts, and that its calls
in turn read other weights, as a decode step's layers do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from expertstream.backends import sim
from expertstream.kernels import MoeKernels
from expertstream.timeline import OpKind
from microbench import kernels_gemv


def test_a_plain_copy_counts_the_bytes_it_reads_and_writes() -> None:
    with sim.open() as backend:
        device = backend.device(0)
        with device.stream() as stream:

            def time_ms(launch: Callable[[], None]) -> float:
                launch()
                stream.synchronize()
                return 0.5

            rows = kernels_gemv.measure_copies(device, stream, (0, 4 << 20), time_ms)
        copies = [op.nbytes for op in backend.timeline if op.kind is OpKind.D2D]
    # A size of 0 gives no row and no copy; 4 MiB over 0.5 ms, read and written: 16.8 GB/s.
    assert copies == [4 << 20]
    (row,) = rows
    assert (row.kernel, row.tensor, row.pairs) == ("copy_d2d", "copy (read+write)", 0)
    assert row.weight_mb == pytest.approx(4.194304)
    assert row.gbs == pytest.approx(2 * (4 << 20) / 0.5e-3 / 1e9)


def test_rotating_ids_give_each_call_experts_no_other_call_of_the_turn_reads() -> None:
    ids = kernels_gemv.rotating_ids(np.random.default_rng(0), 128, 8)
    assert ids.shape == (16, 8)
    assert sorted(ids.reshape(-1).tolist()) == list(range(128))  # 16 calls, each expert once
    one = kernels_gemv.rotating_ids(np.random.default_rng(0), 6, 4)
    assert one.shape == (1, 4) and len(set(one[0].tolist())) == 4


def test_calls_in_turn_read_other_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timed call of a row takes the next set of experts and the next copy of a dense tensor."""
    read: list[tuple[int, int, int]] = []  # (weights address, ids offset, pairs) of each mul_mat_id call
    plain = MoeKernels.mul_mat_id

    def spy(self: MoeKernels, stream: Any, w: Any, *args: Any, **kwargs: Any) -> None:
        ids, top_k = args[6], args[8]  # after w_type, n_expert, n_out, n_in, x, x_per_pair
        read.append((w.address, ids.offset, top_k))
        plain(self, stream, w, *args, **kwargs)

    monkeypatch.setattr(MoeKernels, "mul_mat_id", spy)
    monkeypatch.setattr(kernels_gemv, "DENSE_SHAPES", (("q", 64, 256),))
    monkeypatch.setattr(kernels_gemv, "ROTATION_BYTES", 64 * 144 * 3)  # three copies of the 64-row tensor
    with sim.open() as backend:
        device = backend.device(0)
        with device.stream() as stream:

            def time_ms(launch: Callable[[], None]) -> float:
                for _ in range(4):
                    launch()
                stream.synchronize()
                return 0.5

            gate_up = kernels_gemv.TensorShape("gate/up", 256, 256, False)
            shapes = (gate_up, kernels_gemv.TensorShape("down", 256, 256, True))
            rows = kernels_gemv.measure(device, stream, {}, ("Q4_K",), shapes, 32, 0, time_ms)
    assert {r.tensor for r in rows} >= {"gate/up", "down", "gate+up", "gate+up,down", "dense q"}
    eight = [r for r in read if r[2] == 8]
    # four timed calls a row take four sets of ids in turn (8 pairs of 32 experts: 4 sets)
    assert len({offset for _, offset, _ in eight[:4]}) == 4
    # the dense row's four timed calls, then the one its output is read from: three copies, then the first
    # again; the output from the first
    dense = [address for address, _, pairs in read if pairs == 1][-5:]
    assert len(set(dense[:3])) == 3 and dense[3] == dense[0] and dense[4] == dense[0]

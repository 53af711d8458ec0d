"""microbench/kernels_gemv.py's plain-copy reference on the simulator: what its rows count."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from expertstream.backends import sim
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

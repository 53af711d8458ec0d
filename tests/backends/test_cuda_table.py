"""The CUDA backend's call table where it builds driver structures itself: a chained launch's
configuration, checked without a GPU by standing in for the driver's launch call."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
runtime = pytest.importorskip("cuda.bindings.runtime", reason="cuda-bindings is not installed")

from expertstream.backends import cuda  # noqa: E402


def test_a_chained_launch_asks_for_programmatic_stream_serialization(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(driver, "cuLaunchKernelEx", lambda *args: seen.append(args) or (0,))
    table = cuda._table()
    assert table.launch_chained is not None
    assert table.chained_launches("sm_90") and table.chained_launches("sm_100")
    assert not table.chained_launches("sm_80") and not table.chained_launches("sm_89")
    stream = runtime.cudaStream_t(0x1230)  # the runtime's handle, as the backend's streams hold it
    values, types = (0xABC0, 7), (ctypes.c_void_p, ctypes.c_int32)
    table.launch_chained.fn("function", (3, 2, 1), (128, 1, 1), 512, stream, values, types)
    ((config, function, params, extra),) = seen
    assert (function, params, extra) == ("function", (values, types), 0)
    grid = (config.gridDimX, config.gridDimY, config.gridDimZ)
    block = (config.blockDimX, config.blockDimY, config.blockDimZ)
    assert (grid, block, config.sharedMemBytes, int(config.hStream)) == ((3, 2, 1), (128, 1, 1), 512, 0x1230)
    assert config.numAttrs == 1
    (attr,) = config.attrs
    assert attr.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1

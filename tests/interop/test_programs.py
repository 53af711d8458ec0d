"""Compute steps written with array libraries, run by the scheduler with prefetch off and on."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from expertstream.backends.base import Device, Stream
from expertstream.backends.dlpack import DLDeviceType
from expertstream.errors import InvalidArgument
from expertstream.interop import dlpack_compute, typed_bindings
from expertstream.scheduler import HostRegion, Input, MulMatId, Plan, Scheduler, Split

from .reach import torch_reaching

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"


def test_the_torch_program_of_usage_md(
    device: Device, backend_name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    torch_reaching(device)
    block = next(b for b in re.findall(r"```python\n(.*?)```", USAGE.read_text(), flags=re.S) if "torch_compute" in b)
    monkeypatch.setenv("EXPERTSTREAM_BACKEND", backend_name)
    exec(compile(block, str(USAGE), "exec"), {"__name__": "usage_torch_example"})
    assert capsys.readouterr().out.split("\n")[:2] == ["0 0 fires", "3 4 fires"]


def test_numpy_experts_through_dlpack_compute(device: Device) -> None:
    """The torch program's shape with numpy as the consumer: the adapter's logic on every CI run."""
    if device.dlpack_device[0] is not DLDeviceType.CPU:
        pytest.skip(f"numpy cannot read {device.label} memory; the torch program covers GPUs")
    n_expert, n_out, n_in, tokens, top_k, layers = 4, 16, 32, 24, 2, 3
    rng = np.random.default_rng(0)
    experts = rng.standard_normal((layers, n_expert, n_out, n_in)).astype(np.float32)
    layer_bytes = experts[0].nbytes
    host = device.alloc_pinned(experts.nbytes)
    host.array[:] = experts.reshape(-1).view(np.uint8)
    x = rng.standard_normal((tokens, n_in)).astype(np.float32)
    ids = rng.integers(0, n_expert, (tokens, top_k), dtype=np.int32)
    ids_dev = device.upload(ids)
    seen_streams: list[Stream] = []

    def layer(y: np.ndarray) -> Any:
        def compute(arrays: dict[str, np.ndarray], stream: Stream) -> None:
            seen_streams.append(stream)
            w = arrays["w"]
            for e in range(n_expert):
                token, k = np.nonzero(ids == e)
                y[token, k] = x[token] @ w[e].T

        return dlpack_compute(compute, np.from_dlpack, {"w": (np.float32, (n_expert, n_out, n_in))})

    results = {}
    for slots in (0, 3):
        ys = [np.zeros((tokens, top_k, n_out), np.float32) for _ in range(layers)]
        splits = [
            Split(
                f"layer{i}",
                device,
                (
                    Input(
                        "w",
                        layer_bytes,
                        host=HostRegion(host, i * layer_bytes, layer_bytes),
                        expert_nbytes=layer_bytes // n_expert,
                    ),
                ),
                layer(y),
                MulMatId(ids_dev.view(), tokens * top_k, n_expert, ("w",)),
            )
            for i, y in enumerate(ys)
        ]
        with Scheduler(slots=slots) as scheduler:
            stats = scheduler.run(Plan.of(splits))
            assert set(seen_streams) == {scheduler.stream(device)}
        seen_streams.clear()
        assert stats.device(device.label).fires == (0 if slots == 0 else layers)
        results[slots] = ys
    for i in range(layers):
        assert results[0][i].tobytes() == results[3][i].tobytes()
        ref = np.einsum("ti,tkoi->tko", x, experts[i][ids])
        np.testing.assert_allclose(results[3][i], ref, rtol=1e-5, atol=1e-4)
    ids_dev.close()
    host.close()


def test_layouts_must_name_bound_inputs(device: Device) -> None:
    buf = device.alloc(64)
    stream = device.stream()
    with pytest.raises(InvalidArgument, match="does not bind"):
        typed_bindings(stream, {"w": buf.view()}, {"x": (np.float32, (16,))})
    typed = typed_bindings(stream, {"w": buf.view(), "b": buf.view(0, 8)}, {"w": (np.float32, (4, 4))})
    assert (typed["w"].shape, typed["w"].dtype.name, typed["w"].stream) == ((4, 4), "float32", stream)
    assert (typed["b"].shape, typed["b"].dtype.name) == ((8,), "uint8")
    stream.close()
    buf.close()

"""A model's layers split over two devices give the bytes of the one-device run.

On the simulator two devices are opened for the test (with and without peer access); on a
GPU backend the test needs two devices and is skipped with the reason otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Backend
from expertstream.bench.measure import Settings, measure, measure_h2d_peak
from expertstream.engine.layersplit import LayerSplit
from expertstream.engine.model import Model
from expertstream.engine.offload import ResidentExperts, plan_offload
from expertstream.engine.runner import Batching, MoeRunner, sha256
from expertstream.errors import InvalidArgument
from expertstream.hostmem import HostMemoryMode, HostWeights, RingOptions
from expertstream.model import MoeModel, make_model
from expertstream.scheduler import Scheduler

BATCHING = Batching(tokens=32, ubatch=16, decode_steps=4)
MODES = (HostMemoryMode.MMAP, HostMemoryMode.REGISTERED, HostMemoryMode.PINNED, HostMemoryMode.RING)
SMALL_RING = RingOptions(chunk_bytes=60_000, chunks=3, threads=2)


@pytest.fixture(scope="module", params=["peer", "host"])
def two(request: pytest.FixtureRequest, backend_name: str, backend: Backend) -> Iterator[tuple[Backend, str]]:
    """A backend with two devices, and how the hidden state is expected to cross ("peer" or "host")."""
    if backend_name == "sim":
        with expertstream.backend("sim", devices=2, peer_access=request.param == "peer") as sim:
            yield sim, request.param
        return
    if request.param == "host":
        pytest.skip("peer access cannot be refused on purpose on a GPU backend")
    if len(backend.devices) < 2:
        pytest.skip(f"{backend_name}: {len(backend.devices)} device(s); a layer split needs two")
    yield backend, ""


def _run(runner: MoeRunner, model: MoeModel, mode: HostMemoryMode, slots: int) -> tuple[str, str]:
    copied_to = runner.layer_split.expert_devices
    with (
        HostWeights.open(model, runner.device, mode, copied_to=copied_to, ring=SMALL_RING) as weights,
        Scheduler(slots=slots) as scheduler,
    ):
        stats = scheduler.run(runner.prefill_plan(weights))
        if slots:
            # every device prefetched its own layers' experts: 2 ubatches x 1 layer x 3 tensors each
            assert {label: dev.fires for label, dev in stats.devices.items()} == {d.label: 6 for d in runner.devices}, (
                stats.devices
            )
        for step in range(BATCHING.decode_steps):
            scheduler.run(runner.decode_plan(weights, step))
    prefill, decode = runner.prefill_output(), runner.decode_output()
    assert np.isfinite(prefill).all() and np.isfinite(decode).all()
    return sha256(prefill), sha256(decode)


def test_two_devices_give_the_one_device_bytes(two: tuple[Backend, str], tiny_path: Path) -> None:
    backend, via = two
    first, second = backend.devices[:2]
    with MoeModel.open(tiny_path) as model:
        with MoeRunner(first, model, BATCHING) as alone:
            expected = _run(alone, model, HostMemoryMode.PINNED, 0)
        with MoeRunner([first, second], model, BATCHING) as runner:
            assert runner.layer_split.layers == {first: (0,), second: (1,)}
            if via:
                assert runner.crossings == (via,)
            for mode in MODES:
                for slots in (0, 2, 3):
                    assert _run(runner, model, mode, slots) == expected, (mode, slots)


def test_a_refused_peer_crosses_through_host_memory_and_says_so(
    tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        expertstream.backend("sim", devices=2, peer_access=False) as sim,
        MoeModel.open(tiny_path) as model,
        caplog.at_level(logging.WARNING),
    ):
        baseline = [device.free_memory() for device in sim.devices]
        with MoeRunner(sim.devices, model, BATCHING) as runner:
            assert runner.crossings == ("host",)
        messages = [r.getMessage() for r in caplog.records if "crosses through page-locked host memory" in r.message]
        assert len(messages) == 1 and "sim:1 cannot read sim:0" in messages[0]
        assert [device.free_memory() for device in sim.devices] == baseline


def test_resident_experts_live_on_their_layers_device(two: tuple[Backend, str], tiny_path: Path) -> None:
    backend, _ = two
    devices = backend.devices[:2]
    with MoeModel.open(tiny_path) as model:
        split = LayerSplit(model, devices)
        offload = plan_offload(model, split, n_cpu_moe=1)
        assert offload.streamed == (0,) and offload.resident == (1,)
        with ResidentExperts(model, split, offload) as resident:
            assert {view.buffer.device for view in resident.views.values()} == {devices[1]}
        settings = Settings(BATCHING, (0, 3), (HostMemoryMode.REGISTERED,), n_cpu_moe=1, warmup=False)
        rows = measure(backend, list(devices), model, settings).rows
        alone = measure(backend, devices[0], model, settings).rows
    assert {row.output_sha256 for row in rows} == {alone[0].output_sha256}
    assert all(row.devices == 2 and row.layers_streamed == 1 for row in rows)


def test_the_two_device_peak_is_what_both_links_move_at_once() -> None:
    # Virtual time: each simulated device has its own link at the profile's pinned rate.
    with expertstream.backend("sim", devices=2) as sim:
        one = measure_h2d_peak(sim, sim.devices[0], 8 << 20)
        both = measure_h2d_peak(sim, list(sim.devices), 8 << 20)
    # Nearly twice one link: only the enqueuing thread's own time is shared.
    assert 1.8 * one.gbps < both.gbps <= 2 * one.gbps
    # The probe is its copies' median, reported with their range.
    assert one.copies == 4 and one.low_gbps <= one.gbps <= one.high_gbps


def test_a_split_needs_distinct_devices_and_a_layer_each(tiny_path: Path) -> None:
    with expertstream.backend("sim", devices=3) as sim, MoeModel.open(tiny_path) as model:
        with pytest.raises(InvalidArgument, match="3 devices for 2 MoE layers"):
            LayerSplit(model, sim.devices)
        with pytest.raises(InvalidArgument, match="repeat"):
            LayerSplit(model, [sim.devices[0], sim.devices[0]])
        with pytest.raises(InvalidArgument, match="at least one device"):
            LayerSplit(model, [])


def test_layers_are_split_in_order_as_evenly_as_they_go() -> None:
    # Leading dense layers have no MoE layer: indexes need not start at 0.
    model = SimpleNamespace(layers=[SimpleNamespace(index=i, experts=()) for i in range(1, 6)])
    with expertstream.backend("sim", devices=2) as sim:
        split = LayerSplit(model, sim.devices)  # type: ignore[arg-type]
        assert split.layers == {sim.devices[0]: (1, 2, 3), sim.devices[1]: (4, 5)}
        assert split.device_of(4) is sim.devices[1]


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt-oss"])
def test_the_whole_model_over_two_devices_gives_the_one_device_logits(
    two: tuple[Backend, str], tmp_path: Path, preset: str
) -> None:
    """Embeddings on the first device, the head on the last, each layer's attention and KV cache on
    its own device: prefill and decode logits are the one-device bytes."""
    backend, _ = two
    path = make_model(preset, "Q8_0", tmp_path / f"{preset}.gguf", seed=3)
    tokens = np.random.default_rng(0).integers(3, 512, 40).tolist()
    outputs = []
    for devices in ((0,), (0, 1)):
        with Model.open(path, backend=backend, devices=devices, ubatch=16) as model:
            outputs.append(model.logits(tokens, prompt=32))
    assert np.all(np.isfinite(outputs[0]))
    assert outputs[0].tobytes() == outputs[1].tobytes()

"""Every host memory mode over a model split in three shards: one mapping per shard, bytes exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from model import files  # tests/model/files.py: pytest puts tests/ on sys.path

from expertstream.backends.base import Backend, HostBuffer
from expertstream.hostmem import HostMemoryMode, HostWeights, RingOptions, RingRegion
from expertstream.model import MoeModel

SMALL_RING = RingOptions(chunk_bytes=5_000, chunks=3, threads=2)


@pytest.fixture(scope="module")
def split_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("split")
    keys = files.moe_keys("qwen3moe", 3, 4, 96)
    return files.write_file(
        folder / "m.gguf", "qwen3moe", keys, files.model_tensors([(4, 96)] * 3, seed=2), split_max_tensors=5
    )


@pytest.mark.parametrize("mode", list(HostMemoryMode), ids=lambda m: m.value)
def test_every_mode_delivers_every_shard(backend: Backend, split_path: Path, mode: HostMemoryMode) -> None:
    device = backend.device(0)
    with MoeModel.open(split_path) as model, HostWeights.open(model, device, mode, ring=SMALL_RING) as weights:
        assert model.n_shards == 3
        buffers = set()
        for name, info in model.tensors.items():
            source = weights[name]
            dst = device.alloc(info.nbytes)
            with device.stream() as stream:
                source.enqueue_h2d(stream, dst, 0, 0, info.nbytes)
                stream.synchronize()
            assert np.array_equal(dst.read(), model.raw(info)), name
            dst.close()
            buffers.add(id(source.ring) if isinstance(source, RingRegion) else id(getattr(source, "buffer", None)))
        if weights.mode in (HostMemoryMode.MMAP, HostMemoryMode.REGISTERED):
            assert len(buffers) == 3, "one mapping per shard"
        if weights.mode is HostMemoryMode.RING:
            assert len(buffers) == 1, "one ring over every shard's mapping"
        if weights.mode is HostMemoryMode.REGISTERED:
            assert weights.stats.registered_bytes == sum(p.stat().st_size for p in model.paths)


def test_registration_is_per_shard(backend: Backend, split_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = backend.device(0)
    if not device.capabilities.host_register_read_only:
        pytest.skip(f"{device.label} cannot register host memory read-only")
    registered: list[int] = []
    real = HostBuffer.register

    def counting(self: HostBuffer, *args: object, **kwargs: object) -> None:
        registered.append(self.nbytes)
        real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(HostBuffer, "register", counting)
    with HostWeights.open(split_path, device, "registered") as weights:
        assert weights.mode is HostMemoryMode.REGISTERED
        assert sorted(registered) == sorted(p.stat().st_size for p in weights.model.paths)

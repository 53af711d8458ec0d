"""The model's tensors on the device: views into a few shared allocations, each holding its own bytes."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Usage
from expertstream.engine import uploads as uploads_module
from expertstream.engine.uploads import ARENA_ALIGN, Uploads
from expertstream.ggml import padded_size
from expertstream.model import MoeModel, TensorInfo, make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny", "Q4_K_M", tmp_path_factory.mktemp("uploads") / "tiny.gguf")


def _dense_tensors(model: MoeModel) -> list[TensorInfo]:
    experts = {t.name for t in model.expert_tensors}
    return [t for t in model.tensors.values() if t.name not in experts]


@pytest.mark.parametrize("arena_max", [uploads_module.ARENA_MAX_BYTES, 64 << 10], ids=["default", "small arenas"])
def test_the_models_tensors_share_allocations_and_each_reads_its_own_bytes(
    tiny: Path, arena_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(uploads_module, "ARENA_MAX_BYTES", arena_max)
    with expertstream.backend("sim", data=True) as backend, MoeModel.open(tiny) as model:
        device = backend.device(0)
        free_before = device.free_memory()
        tensors = _dense_tensors(model)
        with Uploads(device, model) as uploads:
            views = {t.name: uploads.resident(t) for t in tensors}
            assert all(buf.usage is Usage.WEIGHTS for buf in uploads.buffers)
            # a few arenas, each doubling the last, and tensors past half the largest on their own
            large = sum(v.nbytes > arena_max // 2 for v in views.values())
            assert len(uploads.buffers) < len(tensors) and len(uploads.buffers) <= large + 16
            spans: dict[int, list[tuple[int, int]]] = {}
            for info in tensors:
                view = views[info.name]
                assert view.offset % ARENA_ALIGN == 0
                spans.setdefault(id(view.buffer), []).append((view.offset, view.end))
                got = view.buffer.read(view.offset, view.nbytes)
                if info.qtype.name in ("F32", "F16", "BF16"):
                    want = uploads_module.tensor_floats(model, info).view(np.uint8)
                    assert got.tobytes() == want.tobytes()
                else:
                    raw = np.ascontiguousarray(model.raw(info)).view(np.uint8).reshape(-1)
                    assert view.nbytes == padded_size(info.nbytes, info.qtype, info.ne0)
                    assert got[: raw.nbytes].tobytes() == raw.tobytes()
                    assert not got[raw.nbytes :].any(), f"{info.name}: the tail past the rows is not zero"
            for ranges in spans.values():  # no two tensors share a byte
                ranges.sort()
                assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ranges))
        assert device.free_memory() == free_before


def test_kv_caches_share_arenas_of_their_own_usage(tiny: Path) -> None:
    with expertstream.backend("sim", data=True) as backend, MoeModel.open(tiny) as model:
        device = backend.device(0)
        with Uploads(device, model) as uploads:
            weight = uploads.resident(_dense_tensors(model)[0])
            caches = [uploads.view(80 * 512 * 2) for _ in range(96)]  # a 48-layer file's K and V at 80 tokens
            assert len({id(v.buffer) for v in caches}) < 8 and all(v.offset % ARENA_ALIGN == 0 for v in caches)
            assert all(v.buffer.usage is Usage.COMPUTE for v in caches) and weight.buffer.usage is Usage.WEIGHTS
            assert uploads.weight_bytes == weight.buffer.alloc_size  # the caches count as what they are
            for k, v in enumerate(caches):  # each its own bytes
                v.buffer.write(np.full(v.nbytes, k, np.uint8), v.offset)
            assert all((v.buffer.read(v.offset, v.nbytes) == k).all() for k, v in enumerate(caches))

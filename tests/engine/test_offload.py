"""Partial offload: the first MoE layers stream, the rest stay on the device, the bytes stay the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from expertstream.backends.base import Backend
from expertstream.engine.offload import ResidentExperts, parse_gpu_memory, plan_offload
from expertstream.engine.runner import Batching, MoeRunner, sha256
from expertstream.errors import InvalidArgument
from expertstream.hostmem import HostWeights
from expertstream.model import MoeModel
from expertstream.scheduler import Scheduler

PREFILL = Batching(tokens=32, ubatch=16)  # two ubatches at prefill scale


@pytest.mark.parametrize("mode", ["pinned", "mmap"])
def test_outputs_are_identical_whatever_streams(backend: Backend, tiny_path: Path, mode: str) -> None:
    device = backend.device(0)
    hashes = {}
    with MoeModel.open(tiny_path) as model, MoeRunner(device, model, PREFILL) as runner:
        n_moe = len(model.layers)
        with HostWeights.open(model, device, mode) as weights:
            for n_cpu_moe in (n_moe, n_moe // 2, 0):
                plan = plan_offload(model, device, n_cpu_moe=n_cpu_moe)
                assert (plan.layers_streamed, plan.layers_resident) == (n_cpu_moe, n_moe - n_cpu_moe)
                streamed = [t for layer in model.layers[:n_cpu_moe] for t in layer.experts]
                assert plan.streamed_bytes_per_ubatch == sum(t.nbytes for t in streamed)
                with ResidentExperts(model, device, plan) as resident:
                    for slots in (0, 3):
                        with Scheduler(slots=slots) as scheduler:
                            stats = scheduler.run(runner.prefill_plan(resident.experts(weights)))
                        moved = stats.total("bytes_prefetched") + stats.total("bytes_stock")
                        assert moved == plan.streamed_bytes_per_ubatch * len(PREFILL.ubatches())
                        assert stats.total("fires") == (len(streamed) * len(PREFILL.ubatches()) if slots else 0)
                        hashes[(n_cpu_moe, slots)] = sha256(runner.prefill_output())
    assert len(set(hashes.values())) == 1, hashes


def test_gpu_memory_keeps_as_many_layers_as_fit(backend: Backend, tiny_path: Path) -> None:
    device = backend.device(0)
    with MoeModel.open(tiny_path) as model:
        padded = [sum(device.alloc_size(t.nbytes, t.qtype, t.ne0) for t in layer.experts) for layer in model.layers]
        largest0 = max(device.alloc_size(t.nbytes, t.qtype, t.ne0) for t in model.layers[0].experts)

        def streamed(size: int, slots: int) -> int:
            return plan_offload(model, device, gpu_memory=size, slots=slots, margin=0).layers_streamed

        for slots in (0, 3):
            assert streamed(sum(padded), slots) == 0  # everything fits: no slots needed
        # Without slots, streaming layer 0 needs only the stock scratch of its largest tensor.
        one_streams = padded[1] + largest0
        assert one_streams < sum(padded)
        assert streamed(one_streams, 0) == 1
        assert streamed(one_streams - 1, 0) == 2
        # Gate and up fused: a split reads two streamed tensors, each with its own scratch.
        fused = plan_offload(model, device, gpu_memory=one_streams, host_inputs_per_split=2, margin=0)
        assert fused.layers_streamed == 2
        two = plan_offload(model, device, gpu_memory=one_streams + largest0, host_inputs_per_split=2, margin=0)
        assert two.layers_streamed == 1
        # With 3 slots (and the scratch) streaming one tiny layer costs more than keeping it: all or nothing.
        assert streamed(sum(padded) - 1, 3) == 2
        assert plan_offload(model, device, gpu_memory="auto").layers_streamed == 0  # the simulator has room
        assert plan_offload(model, device, n_cpu_moe=1, gpu_memory=sum(padded), margin=0).layers_streamed == 1
        assert plan_offload(model, device).layers_streamed == len(model.layers)  # default: all stream
        with pytest.raises(InvalidArgument, match="--n-cpu-moe must be >= 0"):
            plan_offload(model, device, n_cpu_moe=-1)


@pytest.mark.parametrize(
    ("text", "value"),
    [("auto", "auto"), ("24G", 24 << 30), ("512M", 512 << 20), ("1.5g", 3 << 29), ("4096", 4096), ("8GiB", 8 << 30)],
)
def test_gpu_memory_sizes(text: str, value: object) -> None:
    assert parse_gpu_memory(text) == value


def test_bad_gpu_memory_is_named() -> None:
    with pytest.raises(InvalidArgument, match="cannot read '24X' as a memory size"):
        parse_gpu_memory("24X")


def test_a_leading_dense_layer_is_skipped_and_the_embeddings_enter_at_the_first_moe_layer(
    backend: Backend, tmp_path: Path
) -> None:
    from model import files  # tests/model/files.py: pytest puts tests/ on sys.path

    widths = [(0, 0), (8, 96), (8, 96)]
    keys = files.moe_keys("qwen3moe", 3, 8, 96, leading_dense_block_count=1)
    path = files.write_file(tmp_path / "dense0.gguf", "qwen3moe", keys, files.model_tensors(widths, seed=4))
    device = backend.device(0)
    digests = set()
    with MoeModel.open(path) as model, MoeRunner(device, model, PREFILL) as runner:
        assert [layer.index for layer in model.layers] == [1, 2]
        with HostWeights.open(model, device, "pinned") as weights:
            for slots in (0, 3):
                with Scheduler(slots=slots) as scheduler:
                    stats = scheduler.run(runner.prefill_plan(weights))
                assert stats.total("bytes_prefetched") + stats.total("bytes_stock") > 0
                output = runner.prefill_output()
                assert np.isfinite(output).all() and output.any(), "the embeddings reached the hidden state"
                digests.add(sha256(output))
    assert len(digests) == 1

"""A synthetic model written with a seed loads back with the same metadata, shapes and bytes."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from expertstream.bench.placeholder import write_sparse_model
from expertstream.errors import InvalidArgument
from expertstream.model import (
    ModelError,
    MoeModel,
    TensorRole,
    TensorSpec,
    generate,
    get_preset,
    make_model,
    start_model_file,
    tensor_specs,
)

TINY = get_preset("tiny")

# The expert types make_model generates weights for; the kernels read more (EXPERT_TYPES).
WRITTEN_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
)


@pytest.mark.parametrize("qtype", WRITTEN_TYPES, ids=lambda t: t.name)
def test_tiny_model_round_trips_metadata_shapes_and_bytes(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    path = make_model("tiny", qtype, tmp_path / "tiny.gguf", seed=7)
    file_bytes = path.read_bytes()
    with MoeModel.open(path) as model:
        assert (model.arch, model.n_layer, model.n_expert, model.top_k, model.n_embd, model.n_ff) == (
            "qwen3moe",
            TINY.n_layer,
            TINY.n_expert,
            TINY.top_k,
            TINY.n_embd,
            TINY.n_ff_exp,
        )
        specs = tensor_specs(TINY, qtype, TINY.n_layer)
        assert sorted(model.tensors) == sorted(s.name for s in specs)
        for spec in specs:
            info = model.tensor(spec.name)
            assert (info.qtype, info.ne, info.nbytes) == (spec.qtype, spec.ne, spec.nbytes)
            expected = generate(spec, seed=7)
            raw = model.raw(info)
            assert np.array_equal(raw, expected), spec.name
            # The offset is absolute in the file, and raw is a read-only view of the mapping.
            assert file_bytes[info.offset : info.end] == expected.tobytes()
            assert np.shares_memory(raw, model.mapping)
            assert not raw.flags.writeable


def test_layout_of_each_layer(tmp_path: Path) -> None:
    with MoeModel.open(make_model("tiny", "Q4_0", tmp_path / "tiny.gguf")) as model:
        layer = model.layers[1]
        assert layer.router.name == "blk.1.ffn_gate_inp.weight"
        assert layer.router.qtype is GGMLQuantizationType.F32
        assert layer.router.ne == (TINY.n_embd, TINY.n_expert)
        assert layer.gate.ne == layer.up.ne == (TINY.n_embd, TINY.n_ff_exp, TINY.n_expert)
        assert layer.down.ne == (TINY.n_ff_exp, TINY.n_embd, TINY.n_expert)
        assert layer.down.ne0 % 512 != 0  # the tiny preset exercises the row padding
        assert layer.up.slice_nbytes * TINY.n_expert == layer.up.nbytes
        assert len(model.expert_tensors) == 3 * TINY.n_layer


def test_seed_changes_the_weights_and_the_same_seed_repeats_them(tmp_path: Path) -> None:
    a = make_model("tiny", "Q8_0", tmp_path / "a.gguf", seed=1).read_bytes()
    b = make_model("tiny", "Q8_0", tmp_path / "b.gguf", seed=1).read_bytes()
    c = make_model("tiny", "Q8_0", tmp_path / "c.gguf", seed=2).read_bytes()
    assert a == b
    assert a != c


def test_layers_option_writes_fewer_layers_with_the_same_shapes(tmp_path: Path) -> None:
    with MoeModel.open(make_model("tiny", "F16", tmp_path / "one.gguf", layers=1)) as model:
        assert model.n_layer == 1
        assert list(model.tensors) == [s.name for s in tensor_specs(TINY, GGMLQuantizationType.F16, 1)]


@pytest.mark.parametrize("qtype", WRITTEN_TYPES, ids=lambda t: t.name)
def test_generated_weights_are_finite_and_scaled_to_fan_in(qtype: GGMLQuantizationType) -> None:
    for spec in tensor_specs(TINY, qtype, 1):
        values = dequantize(generate(spec, seed=0).reshape(spec.byte_shape), spec.qtype)
        assert np.isfinite(values).all(), spec.name
        rms = float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))
        target = 1 / math.sqrt(spec.ne[0])
        assert target / 2 < rms < target * 2, (spec.name, rms, target)


_T = GGMLQuantizationType


@pytest.mark.parametrize(
    "qtype", [_T.IQ1_S, _T.IQ1_M, _T.IQ2_XXS, _T.IQ2_XS, _T.IQ2_S, _T.IQ3_XXS, _T.IQ3_S], ids=lambda t: t.name
)
def test_generated_i_quant_blocks_are_finite_and_scaled_to_fan_in(qtype: GGMLQuantizationType) -> None:
    """Random bytes with a set scale are valid i-quant blocks: every index and sign pattern is."""
    spec = TensorSpec("blk.0.ffn_up_exps.weight", TensorRole.UP, 0, qtype, (2048, 16, 4))
    raw = generate(spec, seed=0)
    values = dequantize(raw.reshape(spec.byte_shape), qtype)
    assert np.isfinite(values).all()
    rms = float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))
    target = 1 / math.sqrt(spec.ne[0])
    assert target / 2 < rms < target * 2, (rms, target)
    assert np.array_equal(raw, generate(spec, seed=0))


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gpt-oss-20b"])
@pytest.mark.parametrize("qtype", WRITTEN_TYPES, ids=lambda t: t.name)
def test_large_preset_shapes_agree_with_gguf(preset: str, qtype: GGMLQuantizationType) -> None:
    p = get_preset(preset)
    specs = tensor_specs(p, qtype, 1)
    for spec in specs:
        assert gguf.quant_shape_from_byte_shape(spec.byte_shape, spec.qtype) == tuple(reversed(spec.ne))
    gate = next(s for s in specs if s.name == "blk.0.ffn_gate_exps.weight")
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert gate.nbytes == p.n_expert * p.n_ff_exp * p.n_embd // block * size


def test_closed_model_refuses_access(tmp_path: Path) -> None:
    model = MoeModel.open(make_model("tiny", "Q4_0", tmp_path / "tiny.gguf"))
    view = model.raw("blk.0.ffn_up_exps.weight")
    model.close()
    with pytest.raises(ModelError, match="closed"):
        model.raw("blk.0.ffn_up_exps.weight")
    assert view.nbytes > 0  # views handed out earlier stay valid


def test_start_model_file_leaves_the_data_to_the_caller(tmp_path: Path) -> None:
    path = tmp_path / "zeros.gguf"
    writer, specs = start_model_file("tiny", "Q8_0", path, layers=1)
    for spec in specs:
        writer.write_tensor_data(np.zeros(spec.nbytes, dtype=np.uint8))
    writer.close()
    reference = make_model("tiny", "Q8_0", tmp_path / "random.gguf", layers=1)
    with MoeModel.open(path) as zeros, MoeModel.open(reference) as model:
        assert zeros.tensors == model.tensors  # same names, types, shapes and offsets
        assert not any(zeros.raw(name).any() for name in zeros.tensors)


def test_spread_layers_run_from_the_first_to_the_last(tmp_path: Path) -> None:
    path = write_sparse_model("qwen3-30b-a3b", "Q4_0", tmp_path / "five.gguf", layers=5)
    with MoeModel.open(path) as model:
        indices = [layer.index for layer in model.layers]
        assert len(indices) == 5
        for count, want in ((1, [0]), (2, [0, 4]), (3, [0, 2, 4]), (5, [0, 1, 2, 3, 4])):
            with model.spread_layers(count) as sample:
                assert [layer.index for layer in sample.layers] == [indices[i] for i in want]
        for count in (0, 6):
            with pytest.raises(InvalidArgument, match=f"asked for {count} of 5"):
                model.spread_layers(count)


def test_spread_layers_are_a_smaller_model_over_the_same_bytes(tmp_path: Path) -> None:
    with MoeModel.open(make_model("tiny", "Q4_0", tmp_path / "tiny.gguf")) as model:
        with model.spread_layers(2) as both, model.spread_layers(1) as first:
            assert first.expert_tensors == model.layers[0].experts
            name = both.layers[1].experts[0].name
            assert np.array_equal(both.raw(name), model.raw(name))
        assert model.raw(name).nbytes > 0  # closing the view leaves the model open

"""The structure check names what is wrong with a damaged file, and passes every well-formed one."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType

from expertstream.model import ModelError, MoeModel, get_preset, make_model
from expertstream.model.structure import check_structure

from . import files, fuzz

PRESET = dataclasses.replace(get_preset("tiny"), n_embd=64, n_ff_exp=32, n_vocab=260)


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> fuzz.FileMap:
    return fuzz.map_file(make_model(PRESET, "Q8_0", tmp_path_factory.mktemp("seed") / "m.gguf"))


def _refusal(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelError) as err:
        MoeModel.open(path)
    assert str(err.value).startswith(f"{path}: ")
    return str(err.value)


def _entry(fmap: fuzz.FileMap, name: str) -> fuzz.Entry:
    return next(e for e in fmap.metadata if e.name == name)


def _tensor(fmap: fuzz.FileMap, name: str) -> fuzz.TensorData:
    return next(t for t in fmap.tensors if t.name == name)


def test_an_array_count_past_the_end_is_refused_without_reading_it(seed: fuzz.FileMap, tmp_path: Path) -> None:
    count = next(p for p in _entry(seed, "tokenizer.ggml.token_type").parts if p.kind == "count")
    message = _refusal(tmp_path, fuzz.put(seed.data, count, 2**40))
    assert "metadata key 'tokenizer.ggml.token_type' declares 1099511627776 elements of INT32" in message


def test_nested_arrays_are_refused(seed: fuzz.FileMap, tmp_path: Path) -> None:
    entry = _entry(seed, "qwen3moe.expert_count")
    nested = struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.ARRAY, 1) + struct.pack("<IQ", 0, 0)
    head = fuzz.replace(seed.data[: seed.infos_end], entry.value_at - 4, entry.end, nested)
    assert "'qwen3moe.expert_count' is an array of arrays" in _refusal(tmp_path, fuzz.rebuild(seed, head))


@pytest.mark.parametrize(("value", "problem"), [(0, "is 0; expected a power of two"), (48, "is 48; expected")])
def test_a_bad_alignment_is_named(seed: fuzz.FileMap, tmp_path: Path, value: int, problem: str) -> None:
    end = seed.metadata[-1].end
    entry = fuzz.pack_string("general.alignment") + fuzz.pack_value(GGUFValueType.UINT32, value)
    head = fuzz.replace(seed.data[: seed.infos_end], end, end, entry)
    assert f"'general.alignment' {problem}" in _refusal(tmp_path, fuzz.rebuild(seed, head, kv_delta=1))


def test_overlapping_tensors_are_named(seed: fuzz.FileMap, tmp_path: Path) -> None:
    up, down = _tensor(seed, "blk.0.ffn_up_exps.weight"), _tensor(seed, "blk.0.ffn_down_exps.weight")
    data = fuzz.put(seed.data, down.offset_part, fuzz.get(seed.data, up.offset_part) + seed.alignment)
    message = _refusal(tmp_path, data)
    assert "the data of tensors blk.0.ffn_up_exps.weight" in message and "overlap" in message


def test_a_misaligned_offset_is_named(seed: fuzz.FileMap, tmp_path: Path) -> None:
    gate = _tensor(seed, "blk.1.ffn_gate_exps.weight")
    data = fuzz.put(seed.data, gate.offset_part, fuzz.get(seed.data, gate.offset_part) + 1)
    assert "blk.1.ffn_gate_exps.weight: its data offset" in _refusal(tmp_path, data)
    assert "is not a multiple of the alignment 32" in _refusal(tmp_path, data)


def test_rows_that_do_not_fill_whole_blocks_are_named(seed: fuzz.FileMap, tmp_path: Path) -> None:
    gate = _tensor(seed, "blk.0.ffn_gate_exps.weight")
    data = fuzz.put(seed.data, gate.dims[0], 63)
    assert "rows of 63 elements, not a multiple of Q8_0's block (32)" in _refusal(tmp_path, data)


def test_an_element_count_beyond_int64_is_named(seed: fuzz.FileMap, tmp_path: Path) -> None:
    gate = _tensor(seed, "blk.0.ffn_gate_exps.weight")
    data = seed.data
    for dim in gate.dims:
        data = fuzz.put(data, dim, 2**32)
    assert "more elements than ggml can address" in _refusal(tmp_path, data)


def test_a_huge_block_count_is_refused_before_it_sizes_anything(tmp_path: Path) -> None:
    keys = files.moe_keys("qwen3moe", 2, 4, 96)
    path = files.write_file(tmp_path / "m.gguf", "qwen3moe", keys, files.model_tensors([(4, 96)] * 2))
    data = fuzz.map_file(path)
    entry = _entry(data, "qwen3moe.block_count")
    value = fuzz.pack_value(GGUFValueType.UINT64, 2**40)
    head = fuzz.replace(data.data[: data.infos_end], entry.value_at - 4, entry.end, value)
    assert "'qwen3moe.block_count' is 1099511627776; at most 4096" in _refusal(tmp_path, fuzz.rebuild(data, head))


def test_a_file_of_the_other_byte_order_passes(tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(path, "qwen3moe", endianess=gguf.GGUFEndian.BIG)
    writer.add_uint32("qwen3moe.block_count", 1)
    writer.add_array("qwen3moe.expert_count", [4])
    writer.add_tensor("t", np.arange(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    check_structure(path)
    assert gguf.GGUFReader(path).byte_order == "S"


def test_an_unreadable_path_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="cannot read"):
        check_structure(tmp_path)  # a directory


def test_the_writer_splits_a_model_as_gguf_split_does(tmp_path: Path) -> None:
    whole = make_model(PRESET, "Q8_0", tmp_path / "one.gguf", seed=3)
    first = make_model(PRESET, "Q8_0", tmp_path / "split.gguf", seed=3, split_max_tensors=10)
    assert first.name == "split-00001-of-00003.gguf"
    with MoeModel.open(whole) as one, MoeModel.open(first) as split:
        assert split.n_shards == 3 and sorted(split.tensors) == sorted(one.tensors)
        for name in one.tensors:
            assert np.array_equal(split.raw(name), one.raw(name)), name

"""qwen3next files hold exactly the keys and tensors llama.cpp's loader asks for, in its shapes.

The expectations below are data taken from llama.cpp's source (src/models/qwen3next.cpp:
load_arch_hparams, load_arch_tensors and the graph; llama_model_base::load_hparams and
create_tensor_qkv), so that CI checks a file without llama.cpp: the required keys, which
layers are recurrent, and every tensor of each layer kind with its shape as a function of
the file's own hyperparameters. llama.cpp refuses a file that lacks a required tensor, holds
one it does not create, or holds one of another shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import pytest
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from expertstream.model import MoeModel, file_specs, get_preset, make_model
from expertstream.model.writer import add_metadata

# get_key without `false`: llama.cpp stops loading without these
REQUIRED_KEYS = [
    "context_length",
    "embedding_length",
    "block_count",
    "attention.layer_norm_rms_epsilon",
    "ssm.conv_kernel",
    "ssm.inner_size",
    "ssm.state_size",
    "ssm.time_step_rank",
    "ssm.group_count",
]
# optional keys the shapes below read, with llama.cpp's defaults where it has one
OPTIONAL_KEYS = {
    "full_attention_interval": 4,
    "attention.head_count": None,
    "attention.head_count_kv": None,
    "attention.key_length": None,
    "attention.value_length": None,
    "expert_count": None,
    "expert_used_count": None,
    "expert_feed_forward_length": None,
    "expert_shared_feed_forward_length": None,
}

Hparams = Mapping[str, int]
Shape = Callable[[Hparams], tuple[int, ...]]


def _key_dim(h: Hparams) -> int:
    return h["ssm.state_size"] * h["ssm.group_count"]


def _value_dim(h: Hparams) -> int:
    return h["ssm.state_size"] * h["ssm.time_step_rank"]


GLOBAL_TENSORS: dict[str, Shape] = {
    "token_embd.weight": lambda h: (h["embedding_length"], h["vocab"]),
    "output_norm.weight": lambda h: (h["embedding_length"],),
    "output.weight": lambda h: (h["embedding_length"], h["vocab"]),  # optional; tied to token_embd without it
}
EVERY_LAYER: dict[str, Shape] = {
    "attn_norm.weight": lambda h: (h["embedding_length"],),
    "post_attention_norm.weight": lambda h: (h["embedding_length"],),
    "ffn_gate_inp.weight": lambda h: (h["embedding_length"], h["expert_count"]),
    "ffn_gate_exps.weight": lambda h: (h["embedding_length"], h["expert_feed_forward_length"], h["expert_count"]),
    "ffn_up_exps.weight": lambda h: (h["embedding_length"], h["expert_feed_forward_length"], h["expert_count"]),
    "ffn_down_exps.weight": lambda h: (h["expert_feed_forward_length"], h["embedding_length"], h["expert_count"]),
    "ffn_gate_inp_shexp.weight": lambda h: (h["embedding_length"],),
    "ffn_gate_shexp.weight": lambda h: (h["embedding_length"], h["expert_shared_feed_forward_length"]),
    "ffn_up_shexp.weight": lambda h: (h["embedding_length"], h["expert_shared_feed_forward_length"]),
    "ffn_down_shexp.weight": lambda h: (h["expert_shared_feed_forward_length"], h["embedding_length"]),
}
# full attention: the query projection carries a gate per head, twice the query width
FULL_ATTENTION: dict[str, Shape] = {
    "attn_q.weight": lambda h: (
        h["embedding_length"],
        h["attention.key_length"] * h["attention.head_count"] * 2,
    ),
    "attn_k.weight": lambda h: (h["embedding_length"], h["attention.key_length"] * h["attention.head_count_kv"]),
    "attn_v.weight": lambda h: (h["embedding_length"], h["attention.value_length"] * h["attention.head_count_kv"]),
    "attn_output.weight": lambda h: (h["attention.key_length"] * h["attention.head_count"], h["embedding_length"]),
    "attn_q_norm.weight": lambda h: (h["attention.key_length"],),
    "attn_k_norm.weight": lambda h: (h["attention.key_length"],),
}
# linear attention (gated delta net), the fused layout: attn_qkv and attn_gate instead of the legacy ssm_in
LINEAR_ATTENTION: dict[str, Shape] = {
    "attn_qkv.weight": lambda h: (h["embedding_length"], 2 * _key_dim(h) + _value_dim(h)),
    "attn_gate.weight": lambda h: (h["embedding_length"], _value_dim(h)),
    "ssm_conv1d.weight": lambda h: (h["ssm.conv_kernel"], 2 * _key_dim(h) + _value_dim(h)),
    "ssm_dt.bias": lambda h: (h["ssm.time_step_rank"],),
    "ssm_a": lambda h: (h["ssm.time_step_rank"],),
    "ssm_ba.weight": lambda h: (h["embedding_length"], 2 * h["ssm.time_step_rank"]),
    "ssm_norm.weight": lambda h: (h["ssm.state_size"],),
    "ssm_out.weight": lambda h: (_value_dim(h), h["embedding_length"]),
}
# llama.cpp keeps these in floats: 1-D weights, the router, and ssm_conv1d (ggml_ssm_conv reads F32)
FLOAT_PARTS = ("ssm_conv1d.weight", "ffn_gate_inp.weight")

QWEN3NEXT_PRESETS = ["tiny-qwen3next", "qwen3-next-80b-a3b", "qwen3.8-flash-next"]


def _is_recurrent(h: Hparams, layer: int) -> bool:
    return (layer + 1) % h["full_attention_interval"] != 0


def expected_tensors(h: Hparams) -> dict[str, tuple[int, ...]]:
    out = {name: shape(h) for name, shape in GLOBAL_TENSORS.items()}
    for i in range(h["block_count"]):
        attention = LINEAR_ATTENTION if _is_recurrent(h, i) else FULL_ATTENTION
        out |= {f"blk.{i}.{part}": shape(h) for part, shape in {**EVERY_LAYER, **attention}.items()}
    return out


def _hparams(arch: str, keys: Mapping[str, Any], n_vocab: int) -> dict[str, int]:
    """The hyperparameters the shapes read, as llama.cpp takes them from the keys (defaults included)."""
    for key in REQUIRED_KEYS:
        assert f"{arch}.{key}" in keys, key
    h = {key: int(keys[f"{arch}.{key}"]) for key in REQUIRED_KEYS}
    for key, default in OPTIONAL_KEYS.items():
        value = keys.get(f"{arch}.{key}", default)
        assert value is not None, f"{key}: the preset's shapes need it"
        h[key] = int(value)
    h["vocab"] = n_vocab
    return h


def _written_keys(preset: str, n_layer: int) -> dict[str, Any]:
    """The keys make-model writes for ``preset``, read back from the writer without writing tensors."""
    writer = gguf.GGUFWriter(None, get_preset(preset).arch)
    add_metadata(writer, get_preset(preset), n_layer, LlamaFileType.MOSTLY_Q4_K_M)
    return {key: value.value for key, value in writer.kv_data[0].items()}


@pytest.mark.parametrize("preset", QWEN3NEXT_PRESETS)
def test_every_tensor_llama_cpp_creates_and_no_other(preset: str) -> None:
    p = get_preset(preset)
    n_layer = min(p.n_layer, 8)  # two full-attention layers in the real presets
    h = _hparams(p.arch, _written_keys(preset, n_layer), p.n_vocab)
    assert h["block_count"] == n_layer
    specs = {s.name: s for s in file_specs(p, "Q4_K_M", n_layer)}
    assert {name: s.ne for name, s in specs.items()} == expected_tensors(h)
    assert any(_is_recurrent(h, i) for i in range(n_layer)) and not all(_is_recurrent(h, i) for i in range(n_layer))
    for name, spec in specs.items():
        if len(spec.ne) == 1 or name.endswith(FLOAT_PARTS):
            assert spec.qtype is T.F32, name


@pytest.mark.parametrize("preset", QWEN3NEXT_PRESETS)
def test_linear_attention_keys_agree_with_the_graph(preset: str) -> None:
    """The graph takes a value head as inner_size / time_step_rank wide, the loader as state_size."""
    h = _hparams("qwen3next", _written_keys(preset, 4), 512)
    assert h["ssm.inner_size"] == _value_dim(h)
    assert h["ssm.time_step_rank"] % h["ssm.group_count"] == 0  # value heads share key heads evenly
    assert h["attention.key_length"] == h["attention.value_length"]


def test_written_file_holds_the_keys_and_tensors(tmp_path: Path) -> None:
    path = make_model("tiny-qwen3next", "Q4_K_M", tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path)
    keys = {name: field.contents() for name, field in reader.fields.items()}
    assert keys["general.architecture"] == "qwen3next"
    h = _hparams("qwen3next", keys, len(keys["tokenizer.ggml.tokens"]))
    assert {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors} == expected_tensors(h)
    # expertstream's own loader reads the MoE part of the same file
    with MoeModel.open(path) as model:
        assert [layer.index for layer in model.layers] == [0, 1]
        assert model.n_expert == 8 and model.top_k == 2

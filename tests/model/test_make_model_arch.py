"""make-model files carry every key and tensor llama.cpp's loader requires for their architecture."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType as T

from expertstream.model import file_specs, get_preset, make_model
from expertstream.model.mixes import use_more_bits
from expertstream.model.writer import parse_type, type_choices

# Keys llama.cpp's load_hparams / vocab loader read as required (get_key without `false`),
# per architecture, on top of the ones every architecture needs.
COMMON_KEYS = [
    "general.architecture",
    "{arch}.context_length",
    "{arch}.embedding_length",
    "{arch}.block_count",
    "{arch}.attention.head_count",
    "{arch}.attention.layer_norm_rms_epsilon",
    "{arch}.expert_count",
    "{arch}.expert_used_count",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
]
ARCH_KEYS = {
    "qwen3moe": [],
    "llama": [],
    "qwen2moe": [],
    "gpt-oss": ["{arch}.expert_feed_forward_length", "{arch}.attention.sliding_window"],
    "deepseek2": [
        "{arch}.leading_dense_block_count",
        "{arch}.attention.kv_lora_rank",
        "{arch}.attention.q_lora_rank",  # required unless the layer count is a Lite model's
        "{arch}.expert_feed_forward_length",
        "{arch}.expert_shared_count",
        "{arch}.expert_weights_scale",
    ],
    "glm4moe": [
        "{arch}.expert_feed_forward_length",
        "{arch}.expert_shared_count",
        "{arch}.expert_weights_scale",
    ],
}
# Per-layer tensors llama.cpp creates as required, besides attn_norm and the router and experts.
ARCH_TENSORS = {
    "qwen3moe": ["attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm"],
    "llama": ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"],
    "qwen2moe": [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate_inp_shexp",
        "ffn_gate_shexp",
        "ffn_up_shexp",
        "ffn_down_shexp",
    ],
    "gpt-oss": ["attn_q", "attn_k", "attn_v", "attn_output", "attn_sinks", "post_attention_norm"],
    "deepseek2": [
        "attn_q",
        "attn_kv_a_mqa",
        "attn_kv_a_norm",
        "attn_k_b",
        "attn_v_b",
        "attn_output",
        "ffn_norm",
        "ffn_gate_shexp",
        "ffn_up_shexp",
        "ffn_down_shexp",
    ],
    "glm4moe": [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "post_attention_norm",
        "ffn_gate_shexp",
        "ffn_up_shexp",
        "ffn_down_shexp",
    ],
}
ARCH_BIASES = {
    "qwen2moe": ["attn_q", "attn_k", "attn_v"],
    "gpt-oss": [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate_inp",
        "ffn_gate_exps",
        "ffn_up_exps",
        "ffn_down_exps",
    ],
    "glm4moe": ["attn_q", "attn_k", "attn_v", "exp_probs_b"],
}
# tokenizer.ggml.model, .pre and the newline token: SentencePiece's byte token, byte-level BPE's
# byte character for 0x0A.
VOCABULARIES = {
    "llama": ("llama", None, "<0x0A>"),
    "qwen3moe": ("gpt2", "qwen2", "\u010a"),
    "qwen2moe": ("gpt2", "qwen2", "\u010a"),
    "gpt-oss": ("gpt2", "gpt-4o", "\u010a"),
    "deepseek2": ("gpt2", "llama-bpe", "\u010a"),
    "glm4moe": ("gpt2", "llama-bpe", "\u010a"),
}
PRESETS = ["tiny", "tiny-mixtral", "tiny-qwen2moe", "tiny-gpt-oss", "tiny-deepseek2", "tiny-glm4moe"]


@pytest.mark.parametrize("preset", PRESETS)
def test_file_has_every_required_key_and_tensor(tmp_path: Path, preset: str) -> None:
    p = get_preset(preset)
    reader = gguf.GGUFReader(make_model(preset, "Q8_0", tmp_path / "m.gguf"))
    keys = set(reader.fields)
    for key in COMMON_KEYS + ARCH_KEYS[p.arch]:
        assert key.format(arch=p.arch) in keys, key
    assert reader.get_field("general.architecture").contents() == p.arch  # type: ignore[union-attr]
    names = {t.name for t in reader.tensors}
    for name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        assert name in names
    for i in range(p.n_layer):
        for part in [
            "attn_norm",
            "ffn_gate_inp",
            "ffn_gate_exps",
            "ffn_up_exps",
            "ffn_down_exps",
            *ARCH_TENSORS[p.arch],
        ]:
            assert f"blk.{i}.{part}.weight" in names, (i, part)
        for part in ARCH_BIASES.get(p.arch, []):
            assert f"blk.{i}.{part}.bias" in names, (i, part)
    model, pre, newline = VOCABULARIES[p.arch]
    assert reader.get_field("tokenizer.ggml.model").contents() == model  # type: ignore[union-attr]
    pre_field = reader.get_field("tokenizer.ggml.pre")
    assert (pre_field.contents() if pre_field is not None else None) == pre
    tokens = reader.get_field("tokenizer.ggml.tokens")
    assert tokens is not None and newline in tokens.contents()  # llama.cpp looks the newline token up
    # every tensor's bytes are where the header says, and nothing else is written
    assert len(names) == len(file_specs(p, "Q8_0", p.n_layer))


def test_deepseek_v2_lite_writes_its_leading_dense_layer() -> None:
    specs = {s.name: s for s in file_specs(get_preset("deepseek-v2-lite"), "Q8_0", 2)}
    assert specs["blk.0.ffn_gate.weight"].ne == (2048, 10944)
    assert "blk.0.ffn_gate_inp.weight" not in specs
    assert specs["blk.1.ffn_gate_shexp.weight"].ne == (2048, 2 * 1408)
    assert specs["blk.1.attn_k_b.weight"].ne == (128, 512, 16)


def test_q4_k_m_raises_ffn_down_by_llama_cpp_rule() -> None:
    p = get_preset("qwen3-30b-a3b")
    specs = {s.name: s.qtype for s in file_specs(p, "Q4_K_M", p.n_layer)}
    for i in range(p.n_layer):
        assert specs[f"blk.{i}.ffn_gate_exps.weight"] is T.Q4_K
        expected = T.Q6_K if use_more_bits(i, p.n_layer) else T.Q4_K
        assert specs[f"blk.{i}.ffn_down_exps.weight"] is expected, i
    assert specs["blk.0.ffn_gate_inp.weight"] is T.F32
    assert specs["output.weight"] is T.Q6_K


def test_mixes_fall_back_where_rows_do_not_fit_256() -> None:
    specs = {s.name: s.qtype for s in file_specs(get_preset("gpt-oss-20b"), "Q4_K_M", 1)}
    assert specs["blk.0.ffn_gate_exps.weight"] is T.Q5_0  # 2880 is not a multiple of 256
    mx = {s.name: s.qtype for s in file_specs(get_preset("gpt-oss-20b"), "MXFP4_MOE", 1)}
    assert mx["blk.0.ffn_up_exps.weight"] is T.MXFP4 and mx["blk.0.attn_q.weight"] is T.Q8_0


def test_q4_k_m_counts_ffn_down_by_layer_not_by_tensor() -> None:
    """gpt-oss has an ffn_down bias per layer: llama.cpp's layer count is still 24, not 48."""
    p = get_preset("gpt-oss-20b")
    specs = {s.name: s.qtype for s in file_specs(p, "Q4_K_M", p.n_layer)}
    for i in range(p.n_layer):
        expected = T.Q8_0 if use_more_bits(i, p.n_layer) else T.Q5_0  # Q6_K / Q4_K fall back: 2880 rows
        assert specs[f"blk.{i}.ffn_down_exps.weight"] is expected, i


def _mix(preset: str, mix: str) -> dict[str, T]:
    p = get_preset(preset)
    return {s.name: s.qtype for s in file_specs(p, mix, p.n_layer)}


@pytest.mark.parametrize(
    ("mix", "experts", "first_downs", "attn_output", "token_embd"),
    [
        ("IQ1_S", T.IQ1_S, T.Q2_K, T.IQ2_XXS, T.Q2_K),
        ("IQ1_M", T.IQ1_M, T.Q2_K, T.IQ2_XXS, T.Q2_K),
        ("IQ2_XXS", T.IQ2_XXS, T.Q2_K, T.IQ2_XXS, T.Q2_K),
        ("IQ2_XS", T.IQ2_XS, T.Q2_K, T.IQ2_XS, T.Q2_K),
        ("IQ2_S", T.IQ2_XS, T.IQ3_S, T.IQ3_S, T.IQ3_S),
        ("IQ2_M", T.IQ2_S, T.IQ3_S, T.IQ3_S, T.IQ3_S),
    ],
)
def test_low_bit_iq_mixes_follow_llama_cpp(mix: str, experts: T, first_downs: T, attn_output: T, token_embd: T) -> None:
    specs = _mix("qwen3-30b-a3b", mix)  # 48 layers, 128 experts, GQA 8
    for i in range(48):
        assert specs[f"blk.{i}.ffn_gate_exps.weight"] is experts
        assert specs[f"blk.{i}.ffn_up_exps.weight"] is experts
        assert specs[f"blk.{i}.ffn_down_exps.weight"] is (first_downs if i < 48 // 8 else experts), i
        assert specs[f"blk.{i}.attn_v.weight"] is T.Q4_K
        assert specs[f"blk.{i}.attn_k.weight"] is experts
        assert specs[f"blk.{i}.attn_output.weight"] is attn_output
    assert specs["output.weight"] is T.Q5_K
    assert specs["token_embd.weight"] is token_embd


def test_iq_mixes_with_eight_experts_raise_attention() -> None:
    specs = _mix("mixtral-8x7b", "IQ2_XS")
    assert specs["blk.0.attn_k.weight"] is T.Q4_K
    assert specs["blk.0.attn_output.weight"] is T.Q5_K
    assert specs["blk.0.attn_q.weight"] is T.IQ2_XS
    iq3 = _mix("mixtral-8x7b", "IQ3_XXS")
    assert iq3["blk.0.attn_v.weight"] is iq3["blk.0.attn_k.weight"] is T.Q8_0
    assert iq3["blk.0.attn_output.weight"] is T.Q5_K


def test_iq3_mixes_follow_llama_cpp() -> None:
    xxs = _mix("qwen3-30b-a3b", "IQ3_XXS")
    assert xxs["blk.0.ffn_down_exps.weight"] is xxs["blk.0.ffn_gate_exps.weight"] is T.IQ3_XXS
    assert xxs["blk.0.attn_k.weight"] is xxs["blk.0.attn_q.weight"] is T.IQ2_S
    assert xxs["blk.0.attn_v.weight"] is T.Q4_K
    assert xxs["blk.0.attn_output.weight"] is T.IQ3_S
    assert (xxs["output.weight"], xxs["token_embd.weight"]) == (T.Q5_K, T.IQ3_S)
    xs = _mix("qwen3-30b-a3b", "IQ3_XS")
    for i in range(48):
        middle = 48 // 8 <= i < 7 * 48 // 8
        assert xs[f"blk.{i}.ffn_up_exps.weight"] is (T.IQ3_XXS if middle else T.IQ3_S), i
        assert xs[f"blk.{i}.ffn_down_exps.weight"] is T.IQ3_S
    m = _mix("qwen3-30b-a3b", "IQ3_M")
    assert [m[f"blk.{i}.ffn_down_exps.weight"] for i in (0, 5, 6)] == [T.Q4_K, T.Q4_K, T.IQ3_S]
    assert m["blk.0.attn_output.weight"] is T.Q4_K and m["output.weight"] is T.Q6_K


def test_iq_mixes_fall_back_to_iq4_nl_where_rows_do_not_fit_256() -> None:
    specs = _mix("gpt-oss-20b", "IQ2_XXS")  # 2880-wide rows
    assert specs["blk.5.ffn_gate_exps.weight"] is T.IQ4_NL
    assert specs["blk.0.ffn_down_exps.weight"] is T.Q4_0  # Q2_K in the first eighth, then its fallback
    assert specs["output.weight"] is T.Q8_0


def test_iq_mix_names_are_types_make_model_takes() -> None:
    assert parse_type("iq2_xxs") == "IQ2_XXS"
    assert {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M"} <= set(
        type_choices()
    )

"""Files the loader must refuse, with messages that name the file and the problem."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from expertstream import InvalidArgument
from expertstream.model import ModelError, MoeModel, get_preset, make_model, parse_expert_type

TINY = get_preset("tiny")
CustomWriter = Callable[..., Path]  # the custom_model fixture

SUPPORTED = (
    "supported expert types are Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, "
    "IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, MXFP4, F16, BF16, F32"
)


def test_valid_custom_file_loads(custom_model: CustomWriter) -> None:
    with MoeModel.open(custom_model()) as model:
        assert model.layers[1].down.qtype is GGMLQuantizationType.Q8_0


@pytest.mark.parametrize("bad_type", [GGMLQuantizationType.TQ1_0, GGMLQuantizationType.Q8_1], ids=lambda t: t.name)
def test_unsupported_expert_type_names_tensor_and_supported_types(
    custom_model: CustomWriter, bad_type: GGMLQuantizationType
) -> None:
    name = "blk.1.ffn_up_exps.weight"
    path = custom_model(overrides={name: (bad_type, (TINY.n_embd, TINY.n_ff_exp, TINY.n_expert))})
    with pytest.raises(ModelError) as err:
        MoeModel.open(path)
    assert f"{name} is {bad_type.name}; {SUPPORTED}" in str(err.value)
    assert str(path) in str(err.value)


def test_missing_tensor_is_named(custom_model: CustomWriter) -> None:
    path = custom_model(drop_tensors=["blk.1.ffn_down_exps.weight"])
    with pytest.raises(ModelError, match=r"tensor blk\.1\.ffn_down_exps\.weight is missing") as err:
        MoeModel.open(path)
    assert str(path) in str(err.value)


def test_missing_metadata_is_named(custom_model: CustomWriter) -> None:
    path = custom_model(drop_keys=["expert_used_count"])
    with pytest.raises(ModelError, match=r"metadata key 'qwen3moe\.expert_used_count' is missing"):
        MoeModel.open(path)


def test_wrong_shape_is_named_with_both_shapes(custom_model: CustomWriter) -> None:
    name = "blk.0.ffn_gate_exps.weight"
    path = custom_model(overrides={name: (GGMLQuantizationType.Q8_0, (TINY.n_embd, 64, TINY.n_expert))})
    with pytest.raises(ModelError, match=rf"{name} has shape \(256, 64, 8\); expected \(256, 192, 8\)"):
        MoeModel.open(path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a model at all")
    with pytest.raises(ModelError, match="not a GGUF file"):
        MoeModel.open(path)


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    whole = make_model("tiny", "Q4_0", tmp_path / "tiny.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelError, match=r"cut.gguf"):
        MoeModel.open(cut)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"preset": "no-such-model"}, "unknown model preset 'no-such-model'"),
        ({"qtype": "F32"}, "the writer cannot fill F32"),
        ({"qtype": "Q9_9"}, "unknown tensor type 'Q9_9'"),
        ({"layers": 3}, "tiny has layers 1..2; asked for 3"),
        ({"seed": -1}, "seed must be non-negative"),
    ],
)
def test_make_model_refuses_bad_arguments_and_writes_nothing(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    args: dict[str, object] = {"preset": "tiny", "qtype": "Q4_0", "layers": None, "seed": 0, **kwargs}
    path = tmp_path / "out.gguf"
    with pytest.raises(InvalidArgument, match=message):
        make_model(args["preset"], args["qtype"], path, layers=args["layers"], seed=args["seed"])  # type: ignore[arg-type]
    assert not path.exists()


@pytest.mark.parametrize("name", ["q4_k", "Q4_K", " q4_K "])
def test_expert_type_names_are_case_insensitive(name: str) -> None:
    assert parse_expert_type(name) is GGMLQuantizationType.Q4_K


def test_unsupported_expert_type_error_names_tensor_type_and_supported() -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_expert_type("tq2_0", tensor="blk.3.ffn_up_exps.weight")
    assert "blk.3.ffn_up_exps.weight: TQ2_0 is not a supported expert type" in str(err.value)
    assert SUPPORTED in str(err.value)

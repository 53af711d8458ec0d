"""The runner's MoE layers per architecture against a float64 forward pass over the file's weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf.quants import dequantize

from expertstream.backends.base import Backend
from expertstream.engine.arch import ffn_config
from expertstream.engine.runner import Batching, MoeRunner, embeddings
from expertstream.hostmem import HostWeights
from expertstream.kernels import reference as ref
from expertstream.kernels.routing import Gating, Routing
from expertstream.model import MoeModel, make_model
from expertstream.scheduler import Scheduler

PRESETS = ["tiny", "tiny-mixtral", "tiny-qwen2moe", "tiny-gpt-oss", "tiny-deepseek2", "tiny-glm4moe", "tiny-qwen3next"]
BATCHING = Batching(tokens=24, ubatch=16)


def _floats(model: MoeModel, name: str) -> np.ndarray | None:
    info = model.optional_tensor(name)
    if info is None:
        return None
    rows = np.asarray(model.raw(info)).reshape(*reversed(info.ne[1:]), -1)
    return np.asarray(dequantize(rows, info.qtype), np.float64).reshape(tuple(reversed(info.ne)))


def _layer_weights(model: MoeModel, i: int) -> ref.FfnWeights:
    def get(part: str) -> np.ndarray | None:
        return _floats(model, f"blk.{i}.{part}")

    def need(part: str) -> np.ndarray:
        value = get(part)
        assert value is not None, part
        return value

    return ref.FfnWeights(
        router=need("ffn_gate_inp.weight"),
        gate=need("ffn_gate_exps.weight"),
        up=need("ffn_up_exps.weight"),
        down=need("ffn_down_exps.weight"),
        router_bias=get("ffn_gate_inp.bias"),
        selection_bias=get("exp_probs_b.bias"),
        gate_bias=get("ffn_gate_exps.bias"),
        up_bias=get("ffn_up_exps.bias"),
        down_bias=get("ffn_down_exps.bias"),
        shared_gate=get("ffn_gate_shexp.weight"),
        shared_up=get("ffn_up_shexp.weight"),
        shared_down=get("ffn_down_shexp.weight"),
        shared_gate_inp=get("ffn_gate_inp_shexp.weight"),
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_matches_the_float64_forward_pass(backend: Backend, tmp_path: Path, preset: str) -> None:
    _check_prefill(backend, make_model(preset, "Q8_0", tmp_path / f"{preset}.gguf", seed=5))


@pytest.mark.parametrize("mix", ["IQ1_M", "IQ2_XXS", "IQ3_S"])
def test_prefill_of_an_i_quant_mix_matches_the_float64_forward_pass(backend: Backend, tmp_path: Path, mix: str) -> None:
    """i-quant gate and up experts beside IQ4_NL down experts (192-wide rows fall back), as llama.cpp mixes them.

    One layer: its routing comes from the exact inputs, so the comparison measures the kernels' rounding
    and not a later layer's near-tie between experts that a rounding difference can flip.
    """
    path = make_model("tiny", mix, tmp_path / f"tiny-{mix}.gguf", seed=5, layers=1)
    with MoeModel.open(path) as model:
        assert (model.layers[0].up.qtype.name, model.layers[0].down.qtype.name) == (mix, "IQ4_NL")
    _check_prefill(backend, path)


def _check_prefill(backend: Backend, path: Path) -> None:
    device = backend.device(0)
    with MoeModel.open(path) as model, MoeRunner(device, model, BATCHING, seed=2) as runner:
        with HostWeights.open(model, device, "pinned") as weights, Scheduler(slots=2) as scheduler:
            scheduler.run(runner.prefill_plan(weights))
        out = runner.prefill_output()
        matrix_paths = runner.matrix_paths
        cfg = ffn_config(model.arch, model.metadata)
        h = embeddings(2, 0, BATCHING.tokens, model.n_embd).astype(np.float64)
        tied = np.zeros(BATCHING.tokens, bool)
        for layer in model.layers:
            x = ref.rms_norm(h)
            weights = _layer_weights(model, layer.index)
            tied |= _near_tie(x, weights, cfg.routing, model.top_k)
            h = h + ref.moe_ffn(x, weights, cfg.routing, model.top_k, cfg.ffn.activation)
    # A token whose float64 routing is a near tie in some layer may take either expert after rounding.
    assert tied.sum() <= BATCHING.tokens // 6, f"{tied.sum()} of {BATCHING.tokens} tokens route through near ties"
    out, h = out[~tied], h[~tied]
    err = ref.relative_error(out, h)
    bound = 2 * max(ref.mul_mat_id_rtol(p) for p in matrix_paths)  # two matrix products deep per layer
    shown = ", ".join(sorted(p.value for p in matrix_paths))
    assert err < bound, f"{path.name}: relative error {err:.3g} over {bound} ({shown})"


# Where the k-th and (k+1)-th selection values of a token are closer than this (relative to its
# largest), the experts chosen may differ between float64 and the kernels' rounding.
NEAR_TIE = 2e-3


def _near_tie(x: np.ndarray, weights: ref.FfnWeights, routing: Routing, top_k: int) -> np.ndarray:
    """Per token: whether its selection of the top_k experts is a near tie (see NEAR_TIE)."""
    logits = x @ weights.router.T + (0.0 if weights.router_bias is None else weights.router_bias)
    if routing.gating is Gating.SOFTMAX:
        values = np.exp(logits - logits.max(axis=1, keepdims=True))
        values /= values.sum(axis=1, keepdims=True)
    elif routing.gating is Gating.SIGMOID:
        values = 1.0 / (1.0 + np.exp(-logits))
    else:
        values = logits
    if weights.selection_bias is not None:
        values = values + weights.selection_bias
    ranked = -np.sort(-values, axis=1)
    if ranked.shape[1] <= top_k:
        return np.zeros(len(values), bool)
    return np.asarray(ranked[:, top_k - 1] - ranked[:, top_k] < NEAR_TIE * np.abs(ranked).max(axis=1), bool)

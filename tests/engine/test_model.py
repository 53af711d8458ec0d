"""The whole model end to end: logits, generation, prefill orders, settings, and bad input."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from expertstream.backends.base import Backend, Stream
from expertstream.engine.hparams import Transformer
from expertstream.engine.model import Model
from expertstream.engine.runner import Batching, MoeRunner
from expertstream.engine.sampling import Sampling
from expertstream.errors import InvalidArgument
from expertstream.hostmem import HostWeights
from expertstream.kernels import MoeKernels, layout
from expertstream.model import ModelError, MoeModel, make_model
from expertstream.model.presets import PRESETS
from expertstream.scheduler import Scheduler
from tests.engine.llamacpp.make import WHOLE

PROMPT = 40


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("whole")
    return {p: make_model(p, "Q8_0", folder / f"{p}.gguf", seed=3) for p in WHOLE}


def _tokens(n: int, n_vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, n_vocab, n)


def _logits(
    backend: Backend,
    path: Path,
    tokens: np.ndarray,
    *,
    ubatch: int,
    layer_major: bool,
    slots: int,
    host_memory: str = "pinned",
) -> np.ndarray:
    with MoeModel.open(path) as model:
        spec = Transformer.read(model)
        device = backend.device(0)
        batching = Batching(len(tokens), ubatch)
        with (
            MoeRunner(device, model, batching, transformer=spec, layer_major=layer_major, all_logits=True) as runner,
            HostWeights.open(model, device, host_memory) as weights,
            Scheduler(slots=slots) as scheduler,
        ):
            runner.set_prompt(tokens)
            scheduler.run(runner.prefill_plan(weights))
            return runner.prompt_logits()


@pytest.mark.parametrize("gemv", [False, True], ids=["tile", "gemv"])
@pytest.mark.parametrize("preset", WHOLE)
def test_decode_steps_give_the_logits_a_longer_prompt_gives(
    backend: Backend, made: dict[str, Path], preset: str, gemv: bool
) -> None:
    """The KV cache carries a prompt into decode: step k's logits are those of the prompt extended by
    the tokens fed so far, computed in one prefill. On the tile kernels (the prefill's) greedy picks
    exactly what the longer prompt says; on the matrix-vector kernels, whose rows take activations on
    the int8 grid, a near tie may go the other way, by no more than that rounding, but for at most one
    step where the rounding flips a near tie of the router's (another expert); a wrong cache moves
    every step's logits by about their spread."""
    with Model.open(made[preset], backend=backend, ubatch=16, gemv=gemv) as model:
        tokens = _tokens(PROMPT, model.transformer.n_vocab)
        generated = [g.token for g in model.generate(list(tokens), 4, Sampling(temperature=0))]
        assert len(generated) == 4
        full = model.logits([*tokens, *generated[:-1]])
    assert np.all(np.isfinite(full))
    rows = full[PROMPT - 1 : PROMPT - 1 + len(generated)]
    below_top = np.array([row.max() - row[token] for row, token in zip(rows, generated, strict=True)])
    if gemv:
        assert np.count_nonzero(below_top > 0.02 * rows.std(axis=1)) <= 1, below_top.tolist()
    else:
        assert (below_top == 0).all(), below_top.tolist()  # greedy picks what the longer prompt says


@pytest.mark.parametrize("preset", WHOLE)
def test_layer_major_and_ubatch_major_prefill_give_the_same_bytes(
    backend: Backend, made: dict[str, Path], preset: str
) -> None:
    tokens = _tokens(PROMPT, 512, seed=1)
    by_ubatch = _logits(backend, made[preset], tokens, ubatch=16, layer_major=False, slots=3)
    by_layer = _logits(backend, made[preset], tokens, ubatch=16, layer_major=True, slots=3)
    assert np.all(np.isfinite(by_ubatch))
    assert by_ubatch.tobytes() == by_layer.tobytes()


def test_slots_do_not_change_the_logits(backend: Backend, made: dict[str, Path]) -> None:
    tokens = _tokens(PROMPT, 512, seed=2)
    outputs = [_logits(backend, made["tiny"], tokens, ubatch=16, layer_major=False, slots=s) for s in (0, 2, 3)]
    assert outputs[0].tobytes() == outputs[1].tobytes() == outputs[2].tobytes()


def test_host_memory_modes_do_not_change_the_logits(backend: Backend, made: dict[str, Path]) -> None:
    tokens = _tokens(PROMPT, 512, seed=5)
    outputs = [
        _logits(backend, made["tiny-qwen2moe"], tokens, ubatch=16, layer_major=True, slots=3, host_memory=mode)
        for mode in ("pinned", "mmap", "registered", "ring")
    ]
    assert all(out.tobytes() == outputs[0].tobytes() for out in outputs[1:])


def test_later_ubatches_attend_to_earlier_ones(backend: Backend, made: dict[str, Path]) -> None:
    """A token's logits depend on the tokens before it, even across a ubatch boundary: changing the
    first token changes the last one's logits."""
    tokens = _tokens(PROMPT, 512, seed=4)
    other = tokens.copy()
    other[0] = (other[0] + 1) % 512
    a = _logits(backend, made["tiny"], tokens, ubatch=16, layer_major=False, slots=0)
    b = _logits(backend, made["tiny"], other, ubatch=16, layer_major=False, slots=0)
    assert not np.allclose(a[-1], b[-1])
    # and never on the tokens after it (causal)
    later = tokens.copy()
    later[-1] = (later[-1] + 1) % 512
    c = _logits(backend, made["tiny"], later, ubatch=16, layer_major=False, slots=0)
    assert a[:-1].tobytes() == c[:-1].tobytes()


def test_generate_yields_text_and_stops_at_max_tokens(backend: Backend, made: dict[str, Path]) -> None:
    with Model.open(made["tiny"], backend=backend) as model:
        pieces = list(model.generate("the quick brown fox", 5, Sampling(temperature=0.7, seed=9)))
        again = list(model.generate("the quick brown fox", 5, Sampling(temperature=0.7, seed=9)))
    assert 1 <= len(pieces) <= 5
    assert [p.token for p in pieces] == [p.token for p in again]  # a seed gives the same draws
    assert all(isinstance(p.text, str) for p in pieces)


def test_bad_input_is_refused_with_a_clear_error(backend: Backend, made: dict[str, Path], tmp_path: Path) -> None:
    with Model.open(made["tiny"], backend=backend, n_ctx=16) as model:
        with pytest.raises(InvalidArgument, match="empty"):
            model.logits([])
        with pytest.raises(InvalidArgument, match="context of 16"):
            model.logits(list(range(3, 20)))
        with pytest.raises(InvalidArgument, match="outside the vocabulary"):
            model.logits([5, 10**6])
    with pytest.raises(InvalidArgument, match="unknown option 'slot'"):
        Model.open(made["tiny"], backend=backend, slot=3)
    odd = make_model(dataclasses.replace(PRESETS["tiny"], name="tiny-96", head_dim=96), "Q8_0", tmp_path / "96.gguf")
    with pytest.raises(ModelError, match="heads are 96 wide; the attention kernels take head sizes"):
        Model.open(odd, backend=backend)


# gpt-oss's sliding window and sinks; deepseek2's latent cache; qwen3next's recurrent states
@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "tiny-deepseek2", "tiny-qwen3next"])
def test_replayed_decode_steps_give_the_tokens_the_issued_ones_give(
    backend: Backend, made: dict[str, Path], preset: str
) -> None:
    greedy = Sampling(temperature=0)
    runs = {}
    for graphs in (False, True):
        with Model.open(made[preset], backend=backend, graphs=graphs, host_memory="pinned") as model:
            runs[graphs] = [g.token for g in model.generate("the quick brown fox", 12, greedy)]
            paths = model.decode_path
        assert paths == ("graph" if graphs else "calls")
    assert runs[False] == runs[True]


def test_the_devices_gather_and_dmas_after_the_ids_give_the_same_bytes(backend: Backend, made: dict[str, Path]) -> None:
    greedy = Sampling(temperature=0)
    ids = list(range(3, 23))
    runs = {}
    for gather in (False, True):
        with Model.open(made["tiny"], backend=backend, gather=gather, host_memory="pinned") as model:
            tokens = [g.token for g in model.generate("the quick brown fox", 8, greedy)]
            runs[gather] = (tokens, model.logits(ids).tobytes())
    assert runs[False] == runs[True]


def test_decode_on_the_matrix_vector_kernels_agrees_with_the_tile_kernels(
    backend: Backend, made: dict[str, Path]
) -> None:
    tokens = _tokens(PROMPT + 6, 512, seed=6).tolist()
    outputs = []
    for gemv in (False, True):
        with Model.open(made["tiny-gpt-oss"], backend=backend, ubatch=16, gemv=gemv) as model:
            outputs.append(model.logits(tokens, prompt=PROMPT))
    # Ubatches of 16 rows take the tile kernels either way; the last 8 and each decode step are few rows.
    assert outputs[0][:32].tobytes() == outputs[1][:32].tobytes()
    assert outputs[0][32:].tobytes() != outputs[1][32:].tobytes()  # other kernels: other rounding
    # The matrix-vector rows take activations on the int8 grid: each row within that rounding, but
    # where it flips a near tie of the router's (one row of these, 37% off: another expert's output).
    assert np.isfinite(outputs[1]).all()
    off = np.linalg.norm(outputs[1] - outputs[0], axis=1) / np.linalg.norm(outputs[0], axis=1)
    assert np.count_nonzero(off > 2e-2) <= 1 and off.max() < 0.6, off.round(4).tolist()
    assert np.median(off[32:]) < 1.5e-2, off.round(4).tolist()


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2moe"])
def test_decode_epilogues_give_the_bytes_of_a_launch_each(
    backend: Backend, made: dict[str, Path], monkeypatch: pytest.MonkeyPatch, preset: str
) -> None:
    """Decode with the last-block epilogues (EXPERTSTREAM_DECODE_EPILOGUES=1: attention with its
    combine, the output projection with its add and norm, down with the combine and next norm, a
    shared expert's rows included) gives the logits of a launch each, and takes those kernels."""
    tokens = _tokens(PROMPT + 6, 512, seed=7).tolist()
    outputs, launched = [], []
    real_launch = Stream.launch

    def noting(self: Stream, kernel: object, *args: object, **kwargs: object) -> None:
        launched[-1].add(str(getattr(kernel, "name", "")))
        real_launch(self, kernel, *args, **kwargs)  # type: ignore[arg-type]

    for epilogues in ("0", "1"):
        monkeypatch.setenv(layout.DECODE_EPILOGUES_VAR, epilogues)
        launched.append(set())
        with monkeypatch.context() as patched:
            patched.setattr(Stream, "launch", noting)
            with Model.open(made[preset], backend=backend) as model:
                outputs.append(model.logits(tokens, prompt=PROMPT))
    assert np.isfinite(outputs[0]).all()
    assert outputs[1].tobytes() == outputs[0].tobytes()
    fused = {"attn_decode_fused", "dense_mul_mat_vec_add_norm", "dense_mul_mat_vec_combine_norm"}
    for names, expected in zip(launched, (set(), fused), strict=True):
        assert {f for f in fused if any(name.startswith(f) for name in names)} == expected


def test_a_decode_epilogues_switch_that_is_neither_0_nor_1_is_refused(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(layout.DECODE_EPILOGUES_VAR, "yes")
    with pytest.raises(InvalidArgument, match=r"EXPERTSTREAM_DECODE_EPILOGUES='yes' is neither 0 nor 1"):
        MoeKernels(backend.device(0))


def test_calls_of_one_shape_reuse_the_runner_and_give_the_same_bytes(backend: Backend, made: dict[str, Path]) -> None:
    tokens = _tokens(PROMPT, 512, seed=7).tolist()
    with Model.open(made["tiny"], backend=backend, ubatch=16) as model:
        first = model.logits(tokens)
        kept = model._run
        other = model.logits(tokens[:20])  # another shape: a runner of its own
        again = model.logits(tokens)
        # a generation left open keeps its runner; a call meanwhile gets another one
        steps = model.generate(tokens, 3, Sampling(temperature=0))
        token = next(steps).token
        during = model.logits(tokens)
        rest = [g.token for g in steps]
    assert kept is not None and other.shape == (20, 512)
    assert first.tobytes() == again.tobytes() == during.tobytes()
    assert token == int(np.argmax(first[-1])) and len(rest) == 2


def test_multi_token_prediction_layers_at_the_end_are_skipped(
    backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GLM-4.5 file's last block predicts further tokens; llama.cpp skips it, and so does this: its
    logits are those of the same file cut before that block."""
    full = make_model("tiny-glm4moe", "Q8_0", tmp_path / "full.gguf", seed=3)
    cut = make_model("tiny-glm4moe", "Q8_0", tmp_path / "cut.gguf", seed=3, layers=1)
    tokens = _tokens(20, 512, seed=8).tolist()
    with Model.open(cut, backend=backend) as model:
        want = model.logits(tokens)
    real = MoeModel.metadata

    def with_nextn(self: MoeModel, key: str) -> object:
        return 1 if key == "glm4moe.nextn_predict_layers" else real(self, key)

    monkeypatch.setattr(MoeModel, "metadata", with_nextn)
    with Model.open(full, backend=backend) as model:
        assert model.transformer.n_layer == 1
        got = model.logits(tokens)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize(
    ("preset", "key", "value", "message"),
    [
        ("tiny", "qwen3moe.rope.dimension_sections", [16, 16, 0, 0], "multi-section RoPE"),
        ("tiny", "qwen3moe.attention.sliding_window_pattern", 4, "sliding-window layer pattern 4"),
        ("tiny", "qwen3moe.nextn_predict_layers", 2, "nextn_predict_layers"),
        ("tiny-deepseek2", "deepseek2.attention.temperature_scale", 0.1, "attention temperature"),
        ("tiny-deepseek2", "deepseek2.attention.key_length_mla", None, "older conversion"),
        ("tiny-qwen3next", "qwen3next.attention.recurrent_layers", [True], "a flag for each of the 2 layers"),
    ],
)
def test_file_settings_not_run_here_are_refused(
    backend: Backend,
    made: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    preset: str,
    key: str,
    value: object,
    message: str,
) -> None:
    real = MoeModel.metadata

    def patched(self: MoeModel, name: str) -> object:
        return value if name == key else real(self, name)

    monkeypatch.setattr(MoeModel, "metadata", patched)
    with pytest.raises(ModelError, match=message):
        Model.open(made[preset], backend=backend)


def test_one_recurrent_flag_for_every_layer_is_read_as_llama_cpp_reads_it(
    made: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = MoeModel.metadata

    def patched(self: MoeModel, name: str) -> object:
        return True if name == "qwen3next.attention.recurrent_layers" else real(self, name)

    with MoeModel.open(made["tiny-qwen3next"]) as model:
        spec = Transformer.read(model)
        assert spec.delta_net is not None and spec.delta_net.recurrent == (True, False)  # full_attention_interval 2
        monkeypatch.setattr(MoeModel, "metadata", patched)
        spec = Transformer.read(model)
        assert spec.delta_net is not None and spec.delta_net.recurrent == (True, True)


def test_a_plan_of_ubatches_out_of_order_is_refused(backend: Backend, made: dict[str, Path]) -> None:
    with MoeModel.open(made["tiny"]) as model:
        spec = Transformer.read(model)
        with MoeRunner(backend.device(0), model, Batching(40, 16), transformer=spec) as runner:
            with pytest.raises(InvalidArgument, match="from the first, in order"):
                runner.prefill_plan({}, [1])
            with pytest.raises(InvalidArgument, match=r"some of 0\.\.2"):
                runner.prefill_plan({}, [3])


def test_perplexity_refuses_no_chunks() -> None:
    from expertstream.engine.perplexity import perplexity

    with pytest.raises(InvalidArgument, match="max_chunks must be at least 1"):
        perplexity(lambda chunk: np.zeros((len(chunk), 8), np.float32), list(range(64)), 16, None, max_chunks=0)


@pytest.mark.parametrize("layer_major", [False, True], ids=["ubatch-major", "layer-major"])
def test_projections_sharing_one_prepared_input_write_the_bytes_of_preparing_each(
    backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layer_major: bool
) -> None:
    """Q, K and V, a dense FFN's gate and up, and a MoE layer's gate and up experts read one input
    rounded and grouped once where they take direct kernels of one tile height, and down takes gate's
    groups: the logits are those of every call preparing its own, in both prefill orders."""
    from expertstream.kernels import MoeKernels

    path = make_model("tiny-glm4moe", "Q4_0", tmp_path / "q40.gguf", seed=3)  # a leading dense layer too
    tokens = _tokens(PROMPT, 512)
    calls = MoeKernels.mul_mat_id
    shared: list[bool] = []
    experts_shared: list[bool] = []  # the MoE layer's gate and up calls

    def counted(self: MoeKernels, *args: object, **kwargs: object) -> None:
        shared.append(kwargs.get("prepared") is not None)
        if args[3] != 1:  # n_expert
            experts_shared.append(shared[-1])
        calls(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(MoeKernels, "mul_mat_id", counted)
    with_sharing = _logits(backend, path, tokens, ubatch=16, layer_major=layer_major, slots=2)
    if not any(shared):
        pytest.skip(f"{backend.device(0).label} takes no direct kernels for Q4_0")
    # In each MoE layer, each of the 3 ubatches' gate prepares; up reads it and down its groups in
    # ubatch-major order, in layer-major order only the last ubatch's (the gates of all three run
    # before the first up, the ups before the first down).
    with MoeModel.open(path) as model:
        n_moe = len(model.layers)
    assert sum(experts_shared) == n_moe * (3 + (2 if layer_major else 6)), experts_shared
    monkeypatch.setattr(MoeKernels, "prepare_direct", _no_preparing)
    monkeypatch.setattr(MoeKernels, "shared_direct", _no_preparing)
    shared.clear()
    each = _logits(backend, path, tokens, ubatch=16, layer_major=layer_major, slots=2)
    assert not any(shared)
    assert with_sharing.tobytes() == each.tobytes()


def _no_preparing(*args: object, **kwargs: object) -> None:
    return None

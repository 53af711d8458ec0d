"""Decode's lookahead: each streamed layer's predicted experts copied while the layer before computes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from expertstream.backends.base import Backend, Stream
from expertstream.engine.decoding import capture_decode_step
from expertstream.engine.hparams import Transformer
from expertstream.engine.model import Model
from expertstream.engine.runner import Batching, MoeRunner, lookahead_experts
from expertstream.engine.sampling import Sampling
from expertstream.errors import DeviceError, InvalidArgument
from expertstream.ggml import padded_size
from expertstream.hostmem import HostWeights
from expertstream.model import MoeModel, make_model
from expertstream.scheduler import Fallback, MulMatId, Plan, Prediction, RunStats, Scheduler, Split, slot_sizes

PROMPT, STEPS = 12, 5


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("lookahead")
    return {p: make_model(p, "Q8_0", folder / f"{p}.gguf", seed=5) for p in ("tiny", "tiny-gpt-oss", "tiny-qwen2moe")}


def _decode(
    backend: Backend,
    path: Path,
    *,
    lookahead: int | None,
    graphs: bool,
    predict: object = None,
    held: list[int] | None = None,
) -> tuple[bytes, RunStats]:
    """The logits of STEPS decode steps after a prompt, every expert in pinned memory; the stats
    of the last step (a replay's are its capture's). ``held``: receives the device bytes the
    decode steps' scheduler holds (the prompt runs on one of its own)."""
    rng = np.random.default_rng(1)
    with MoeModel.open(path) as model:
        spec = Transformer.read(model)
        device = backend.device(0)
        batching = Batching(PROMPT, PROMPT, STEPS)
        with (
            MoeRunner(device, model, batching, transformer=spec, decode_lookahead=lookahead) as runner,
            HostWeights.open(model, device, "pinned") as weights,
            Scheduler(decode_lookahead=lookahead != 0) as scheduler,
        ):
            if predict is not None:
                runner._predict = predict  # type: ignore[method-assign]
            runner.set_prompt(rng.integers(3, spec.n_vocab, PROMPT))
            with Scheduler() as prompt:
                prompt.run(runner.prefill_plan(weights))
            tokens = rng.integers(3, spec.n_vocab, STEPS)
            runner.set_decode_token(0, int(tokens[0]))
            stats = scheduler.run(runner.decode_plan(weights, 0))
            replay = capture_decode_step(runner, scheduler, weights, "test") if graphs else None
            for step in range(1, STEPS):
                runner.set_decode_token(step, int(tokens[step]))
                if replay is None:
                    stats = scheduler.run(runner.decode_plan(weights, step))
                else:
                    runner.decode_step_in(replay.stream, step)
                    replay.launch()
                    runner.decode_step_out(replay.stream, step)
                    stats = replay.finish()
            logits = np.stack([runner.decode_logits(s) for s in range(STEPS)])
            if held is not None:
                held.append(scheduler.device_bytes())
            if replay is not None:
                replay.close()
            return logits.tobytes(), stats


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt-oss", "tiny-qwen2moe"])
@pytest.mark.parametrize("graphs", [False, True], ids=["calls", "graph"])
def test_the_lookahead_copies_predicted_experts_and_gives_the_same_bytes(
    backend: Backend, made: dict[str, Path], preset: str, graphs: bool
) -> None:
    with MoeModel.open(made[preset]) as model:
        n_layers = len(model.layers)
    on, on_stats = _decode(backend, made[preset], lookahead=None, graphs=graphs)
    off, off_stats = _decode(backend, made[preset], lookahead=0, graphs=graphs)
    assert on == off
    # every layer but the first had its experts predicted, each of its expert tensors copied ahead
    assert on_stats.total("lookahead_gathers") == 3 * (n_layers - 1)
    assert off_stats.total("lookahead_gathers") == 0
    assert on_stats.total("gathers") == off_stats.total("gathers") == 3 * n_layers


def test_a_wrong_prediction_only_costs_copies(backend: Backend, made: dict[str, Path]) -> None:
    """Predicted experts the router does not choose are copied and never read; the ones it chooses
    and the prediction missed are gathered after it: the logits stay the same bytes."""

    def predict_expert_0(tokens: Any, after: Any, stream: Stream) -> None:
        predicted = tokens.part.decode_predicted
        stream.memset(predicted, 0, predicted.alloc_size, 0)  # expert 0, k times: at most one right

    wrong, _ = _decode(backend, made["tiny"], lookahead=None, graphs=True, predict=predict_expert_0)
    off, _ = _decode(backend, made["tiny"], lookahead=0, graphs=True)
    assert wrong == off


def test_a_prediction_must_come_from_an_earlier_split(backend: Backend) -> None:
    device = backend.device(0)
    with device.alloc(64) as ids:
        routing = MulMatId(ids.view(0, 8), 2, 4, (), predicted=Prediction(ids.view(8, 8), 2, after="router.L1"))
        later = Split("router.L1", device, (), lambda stream, bindings: None)
        with pytest.raises(InvalidArgument, match="not an earlier split"):
            Plan.of([Split("experts.L1", device, (), lambda stream, bindings: None, routing), later])
        with pytest.raises(InvalidArgument, match="whole int32 ids"):
            Prediction(ids.view(2, 8), 2, after="router.L1")


@pytest.mark.parametrize("count", [1, 2])
def test_every_count_of_predicted_experts_gives_the_same_bytes(
    backend: Backend, made: dict[str, Path], count: int
) -> None:
    ahead, stats = _decode(backend, made["tiny"], lookahead=count, graphs=True)
    off, _ = _decode(backend, made["tiny"], lookahead=0, graphs=True)
    assert ahead == off and stats.total("lookahead_gathers") > 0


def test_a_lookahead_beyond_the_experts_a_token_uses_is_refused(made: dict[str, Path]) -> None:
    with MoeModel.open(made["tiny"]) as model:
        assert lookahead_experts(model, None) == (model.top_k + 1) // 2
        assert lookahead_experts(model, 0) == 0
        for bad in (model.top_k + 1, -1, True):
            with pytest.raises(InvalidArgument, match="decode lookahead"):
                lookahead_experts(model, bad)  # type: ignore[arg-type]


def test_generate_says_what_it_copied_ahead_and_gives_the_same_tokens(backend: Backend, made: dict[str, Path]) -> None:
    greedy = Sampling(temperature=0)
    runs = {}
    for lookahead in (None, 0):
        with Model.open(made["tiny"], backend=backend, host_memory="pinned", decode_lookahead=lookahead) as model:
            runs[lookahead] = [g.token for g in model.generate("the quick brown fox", 8, greedy)]
            copied = model.decode_lookahead
            top_k = model.model.top_k
        assert copied == ((top_k + 1) // 2 if lookahead is None else 0)
    assert runs[None] == runs[0]


def test_a_lookahead_the_runtime_cannot_capture_turns_itself_off_once(
    backend: Backend, made: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    copy_ahead = Scheduler._copy_ahead
    scheduler_of: list[Scheduler] = []  # the one copying ahead, once it has

    def refused_in_captures(self: Scheduler, device: Any, ahead: Any, stats: Any) -> None:
        scheduler_of[:] = [self]
        if self.stream(device).capturing:
            raise DeviceError("operation not permitted when stream is capturing", call="Stream.wait")
        copy_ahead(self, device, ahead, stats)

    predict = MoeRunner._predict
    wasted: list[str] = []  # predictions launched once the scheduler would no longer copy them

    def counted(self: MoeRunner, tokens: Any, after: Any, stream: Stream) -> None:
        if scheduler_of and not scheduler_of[0].decode_lookahead:
            wasted.append(f"layer {after.index}")
        predict(self, tokens, after, stream)

    monkeypatch.setattr(Scheduler, "_copy_ahead", refused_in_captures)
    monkeypatch.setattr(MoeRunner, "_predict", counted)
    with caplog.at_level(logging.WARNING, logger="expertstream.scheduler.scheduler"):
        refused, stats = _decode(backend, made["tiny"], lookahead=None, graphs=True)
    assert wasted == []  # the step was captured again without the predictor's kernels
    off, _ = _decode(backend, made["tiny"], lookahead=0, graphs=True)
    assert refused == off
    assert stats.total("lookahead_gathers") == 0
    assert sum(d.fallbacks[Fallback.LOOKAHEAD_FAILED] for d in stats.devices.values()) == 1
    assert sum("could not be captured" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt-oss"])
def test_decode_copies_a_steps_experts_packed_into_scratch_of_a_few_and_gives_the_same_bytes(
    backend: Backend, made: dict[str, Path], preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    held: list[int] = []
    packed, _ = _decode(backend, made[preset], lookahead=None, graphs=False, held=held)
    with monkeypatch.context() as whole_tensors:
        whole_tensors.setattr(Scheduler, "_packs", lambda self, split: False)
        whole, _ = _decode(backend, made[preset], lookahead=None, graphs=False, held=held)
    assert packed == whole
    with MoeModel.open(made[preset]) as model:
        infos = (model.layers[0].gate, model.layers[0].up, model.layers[0].down)
        top_k, rows = model.top_k, lookahead_experts(model, None) + model.top_k

        def bytes_of(info: Any, experts: int) -> int:
            return experts * info.slice_nbytes + padded_size(info.nbytes, info.qtype, info.ne0) - info.nbytes

        sets = min(2, len(model.layers) - 1)  # the lookahead's, by the parity of the predicted layers
        # the first layer's copies (no prediction) into the stock scratch, the others' beside the
        # predicted experts in a lookahead set; the slot ids and the report word
        expected = max(bytes_of(i, top_k) for i in infos) + sets * sum(bytes_of(i, rows) for i in infos)
        assert held[0] == expected + 4 * top_k + 8
        assert held[1] > held[0] + sets * sum(bytes_of(i, model.n_expert - rows) for i in infos)


def test_decode_frees_the_prompts_slots_and_a_replay_holds_the_only_scratch(
    backend: Backend, made: dict[str, Path]
) -> None:
    """The prompt's prefetch slots and the first step's scratch are freed before the step is
    captured: while the replay runs, the scheduler holds nothing, and generate's staging is the most
    either held (the prompt's slots here)."""
    with Model.open(made["tiny"], backend=backend, host_memory="pinned", slots=3) as model:
        list(model.generate(list(range(3, 3 + PROMPT)), STEPS, Sampling(temperature=0)))  # prompt at prefill scale
        assert model.decode_path == "graph"
        run = model._run
        assert run is not None and run._parts is not None
        _runner, scheduler, _experts, _prefill = run._parts
        assert scheduler.device_bytes() == 0
        fired = [padded_size(t.nbytes, t.qtype, t.ne0) for layer in model.model.layers for t in layer.experts]
        assert model.device_memory.staging == sum(slot_sizes(3, fired))

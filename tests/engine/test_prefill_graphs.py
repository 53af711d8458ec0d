"""A prompt's full ubatches replayed from one captured ubatch give the bytes their calls give."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from expertstream.backends.base import Backend
from expertstream.bench.measure import Settings, measure
from expertstream.engine import prefill as prefill_module
from expertstream.engine.hparams import Transformer
from expertstream.engine.model import Model
from expertstream.engine.prefill import Prefill
from expertstream.engine.runner import Batching, MoeRunner
from expertstream.engine.sampling import Sampling
from expertstream.errors import InvalidArgument
from expertstream.hostmem import HostMemoryMode, HostWeights
from expertstream.model import MoeModel, make_model
from expertstream.scheduler import Scheduler
from tests.engine.llamacpp.make import WHOLE

# Ubatches of 16, 16 and 8 tokens: two replayable, then a shorter one issued as calls.
PROMPT, UBATCH = 40, 16


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("prefill-graphs")
    return {p: make_model(p, "Q8_0", folder / f"{p}.gguf", seed=5) for p in WHOLE}


def _tokens(n: int, n_vocab: int) -> list[int]:
    return np.random.default_rng(2).integers(3, n_vocab, n).tolist()


@pytest.mark.parametrize("preset", WHOLE)
def test_replayed_ubatches_give_the_logits_of_their_calls(backend: Backend, made: dict[str, Path], preset: str) -> None:
    """Every prompt token's logits (a head per ubatch), twice on one model (the second replays the
    first call's graph), against the same calls issued one by one."""
    runs = {}
    for graphs in (False, True):
        with Model.open(made[preset], backend=backend, ubatch=UBATCH, n_cpu_moe=0, graphs=graphs) as model:
            tokens = _tokens(PROMPT, model.transformer.n_vocab)
            first = model.logits(tokens)
            assert model.prefill_path == ("graph" if graphs else "calls")
            again = model.logits(tokens)
        assert first.tobytes() == again.tobytes()
        runs[graphs] = first
    assert np.isfinite(runs[True]).all()
    assert runs[False].tobytes() == runs[True].tobytes()


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt-oss"])
def test_a_generation_after_replayed_ubatches_gives_the_tokens_of_calls(
    backend: Backend, made: dict[str, Path], preset: str
) -> None:
    """The KV cache the replays wrote carries into decode: the same greedy tokens, from a prompt of
    exactly two ubatches (the last's logits from its own head) and of two and a half."""
    greedy = Sampling(temperature=0)
    for n_prompt in (2 * UBATCH, PROMPT):
        runs = {}
        for graphs in (False, True):
            with Model.open(made[preset], backend=backend, ubatch=UBATCH, n_cpu_moe=0, graphs=graphs) as model:
                prompt = _tokens(n_prompt, model.transformer.n_vocab)
                runs[graphs] = [g.token for g in model.generate(prompt, 6, greedy)]
                assert model.prefill_path == ("graph" if graphs else "calls")
        assert runs[False] == runs[True]


def test_stock_copies_from_pinned_memory_are_replayed_too(backend: Backend, made: dict[str, Path]) -> None:
    """Without prefetch slots the experts' copies from pinned memory are part of the captured ubatch."""
    runs = {}
    for graphs in (False, True):
        with Model.open(
            made["tiny"], backend=backend, ubatch=UBATCH, slots=0, host_memory="pinned", prefill_order="ubatch",
            graphs=graphs,
        ) as model:  # fmt: skip
            runs[graphs] = model.logits(_tokens(PROMPT, model.transformer.n_vocab))
            assert model.prefill_path == ("graph" if graphs else "calls")
    assert runs[False].tobytes() == runs[True].tobytes()


def _prefill(backend: Backend, path: Path, **runner_options: object) -> tuple[str | None, str, bytes]:
    """Why a prefill of the prompt through prefetch slots issues calls, its path, and its output."""
    with MoeModel.open(path) as model:
        device = backend.device(0)
        with (
            MoeRunner(device, model, Batching(PROMPT, UBATCH), transformer=Transformer.read(model),
                      **runner_options) as runner,  # type: ignore[arg-type]
            HostWeights.open(model, device, "pinned") as weights,
            Scheduler(slots=3) as scheduler,
            Prefill(runner, scheduler, weights) as prefill,
        ):  # fmt: skip
            runner.set_prompt(_tokens(PROMPT, Transformer.read(model).n_vocab))
            prefill.run()
            prefill.run()
            return prefill.why_calls, prefill.path, runner.prefill_output().tobytes()


def test_prefills_that_cannot_replay_say_why_once_and_run_as_one_plan(
    backend: Backend, made: dict[str, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Experts read from prefetch slots, or layer-major order: the prompt runs as one plan, whose
    lookahead crosses ubatch boundaries, with the same bytes either way; the reason is logged once."""
    monkeypatch.setattr(prefill_module, "_told", set())  # what earlier tests said
    with caplog.at_level(logging.INFO, logger="expertstream.engine.prefill"):
        slots_why, slots_path, by_ubatch = _prefill(backend, made["tiny"])
        _prefill(backend, made["tiny"])
        layer_why, layer_path, by_layer = _prefill(backend, made["tiny"], layer_major=True)
    assert slots_why is not None and "prefetch slots" in slots_why
    assert layer_why is not None and "layer-major" in layer_why
    assert slots_path == layer_path == "calls"
    assert by_ubatch == by_layer
    told = [r.getMessage() for r in caplog.records if "prefetch slots" in r.getMessage()]
    assert len(told) == 1, told


def test_the_step_plan_refuses_what_it_cannot_run(backend: Backend, made: dict[str, Path]) -> None:
    device = backend.device(0)
    with (
        MoeModel.open(made["tiny"]) as model,
        MoeRunner(device, model, Batching(PROMPT, UBATCH), transformer=Transformer.read(model)) as runner,
        HostWeights.open(model, device, "pinned") as weights,
    ):
        assert runner.full_ubatches() == [0, 1]
        with pytest.raises(InvalidArgument, match="ubatch 2 is not one of the full ubatches"):
            runner.prefill_step_in(device.stream(), 2)
        step = runner.prefill_step_plan(weights)
        assert step.splits and not any(s.name.startswith("output.") for s in step.splits)
        assert runner.head_plan(0) is None and runner.head_plan(2) is not None  # the last token's logits only
    with (
        MoeModel.open(made["tiny"]) as model,
        MoeRunner(device, model, Batching(PROMPT, UBATCH)) as alone,
        pytest.raises(InvalidArgument, match="are for the whole model"),
    ):
        alone.prefill_step_plan({})


def test_bench_rows_replay_the_ubatches_and_hash_as_the_calls(backend: Backend, made: dict[str, Path]) -> None:
    """A whole-model row with every expert on the device replays its full ubatches after the warm-up
    captured one (and so does the compute-only baseline), and hashes as the row whose calls are issued."""
    settings = Settings(Batching(PROMPT, UBATCH, 2), (0, 3), (HostMemoryMode.PINNED,), repeats=2, whole=True,
                        n_cpu_moe=0)  # fmt: skip
    results = {}
    with MoeModel.open(made["tiny"]) as model:
        for graphs in (False, True):
            results[graphs] = measure(backend, backend.device(0), model, dataclasses.replace(settings, graphs=graphs))
    for graphs, result in results.items():
        assert [row.prefill_path for row in result.rows] == ["graph" if graphs else "calls"] * 2
        assert all(row.nonfinite == 0 for row in result.rows)
    hashes = {row.output_sha256 for result in results.values() for row in result.rows}
    assert len(hashes) == 1
    assert results[True].baselines.compute_only_sha256 == results[False].baselines.compute_only_sha256

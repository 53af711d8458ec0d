"""A run that leaves work out fails the rows' comparison: outputs start from poison before every hashed run.

Without the poison a run that skips a ubatch would hash the bytes an earlier run (the warm-up, an
earlier repetition, the row before) left in the same buffers, and pass.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

import expertstream
from expertstream.backends.base import Backend, DeviceBuffer, Stream
from expertstream.bench.measure import Measurement, Settings, measure
from expertstream.bench.report import mismatched
from expertstream.cli.output import Report
from expertstream.engine.runner import Batching, ExpertData, MoeRunner
from expertstream.hostmem import HostMemoryMode
from expertstream.model import MoeModel
from expertstream.scheduler import HostRegion, Plan, RunStats, Scheduler, Split
from microbench import soak

# Two ubatches of 16 tokens, two decode steps; slots 0 (stock) and 3 (prefetch).
SETTINGS = Settings(Batching(32, 16, 2), (0, 3), (HostMemoryMode.PINNED,))
UBATCH_ROWS = 16

LeaveOut = Callable[[Scheduler, int, Split], bool]


@pytest.fixture
def sim() -> Iterator[Backend]:
    with expertstream.backend("sim") as backend:
        yield backend


def _run(backend: Backend, tiny_path: Path, settings: Settings = SETTINGS, devices: int = 1) -> Measurement:
    with MoeModel.open(tiny_path) as model:
        return measure(backend, backend.devices[:devices], model, settings)


def _check(result: Measurement) -> int:
    return Report({}, [result]).check()


def _leave_out(monkeypatch: pytest.MonkeyPatch, leave_out: LeaveOut) -> None:
    """Scheduler.run runs each plan without the splits ``leave_out(scheduler, run, split)`` picks.

    ``run`` counts the scheduler's runs of plans that end with the same ubatch or decode step
    (1 for the first): the full prefill plans end with ``ub1``, the warm-up with ``ub0``.
    """
    real_run = Scheduler.run
    runs: weakref.WeakKeyDictionary[Scheduler, dict[str, int]] = weakref.WeakKeyDictionary()

    def run(self: Scheduler, plan: Plan) -> RunStats:
        last = plan.splits[-1].name.rsplit(".", 1)[-1]
        counts = runs.setdefault(self, {})
        counts[last] = counts.get(last, 0) + 1
        return real_run(self, Plan.of([s for s in plan.splits if not leave_out(self, counts[last], s)]))

    monkeypatch.setattr(Scheduler, "run", run)


def test_correct_runs_overwrite_every_poisoned_byte(sim: Backend, tiny_path: Path) -> None:
    """Every output byte a row hashes is written by its run: no poison is left (one device and two
    through host memory, prefill and both decode paths, repeated)."""
    settings = dataclasses.replace(SETTINGS, repeats=2)
    one = _run(sim, tiny_path, settings)
    calls = _run(sim, tiny_path, dataclasses.replace(settings, graphs=False))
    with expertstream.backend("sim", devices=2, peer_access=False) as two_sim:
        two = _run(two_sim, tiny_path, settings, devices=2)
    assert two.rows[0].crossing == "host" and one.rows[0].decode_path == "graph" != calls.rows[0].decode_path
    for result in (one, calls, two):
        assert _check(result) == 0
        assert [r.nonfinite for r in result.rows] == [0, 0]
        assert [r.output_sha256 for r in result.rows] == [one.rows[0].output_sha256] * 2
        assert result.baselines.compute_only_sha256 == one.rows[0].prefill_sha256


def test_a_row_that_drops_a_ubatch_is_flagged(
    sim: Backend, tiny_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With slots, the second ubatch is never run: its rows keep the poison, not the slots-0 row's bytes."""
    _leave_out(monkeypatch, lambda scheduler, run, split: scheduler.slots > 0 and split.name.endswith(".ub1"))
    result = _run(sim, tiny_path)
    assert [r.nonfinite for r in result.rows] == [0, UBATCH_ROWS * _n_embd(tiny_path)]
    assert mismatched(result.rows) == ["slots=0/pinned", "slots=3/pinned"]
    assert _check(result) == 1
    assert "outputs differ between rows" in capsys.readouterr().err


def test_a_repetition_that_drops_a_ubatch_is_flagged_in_every_row_and_the_baseline(
    sim: Backend, tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second timed run of each row and of the compute-only baseline skips a ubatch: the hashed
    output is that run's, not the first run's."""
    unbroken = _run(sim, tiny_path, dataclasses.replace(SETTINGS, repeats=2))
    _leave_out(monkeypatch, lambda scheduler, run, split: run == 2 and split.name.endswith(".ub1"))
    result = _run(sim, tiny_path, dataclasses.replace(SETTINGS, repeats=2))
    assert all(r.nonfinite == UBATCH_ROWS * _n_embd(tiny_path) for r in result.rows)
    assert result.baselines.compute_only_sha256 != unbroken.baselines.compute_only_sha256
    assert {r.prefill_sha256 for r in result.rows}.isdisjoint({r.prefill_sha256 for r in unbroken.rows})
    assert _check(result) == 1


def test_a_decode_step_left_out_is_flagged(sim: Backend, tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second repetition's last decode step is not run: its row keeps the poison, not the first
    repetition's bytes."""
    settings = dataclasses.replace(SETTINGS, repeats=2, graphs=False)
    _leave_out(monkeypatch, lambda scheduler, run, split: run == 2 and split.name.endswith(".step1"))
    result = _run(sim, tiny_path, settings)
    assert [r.nonfinite for r in result.rows] == [_n_embd(tiny_path)] * 2
    assert _check(result) == 1


def test_a_row_that_drops_a_layer_is_flagged(sim: Backend, tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unbroken = _run(sim, tiny_path)
    _leave_out(monkeypatch, lambda scheduler, run, split: scheduler.slots > 0 and ".L1." in split.name)
    result = _run(sim, tiny_path)
    assert result.rows[0].output_sha256 == unbroken.rows[0].output_sha256
    assert result.rows[1].output_sha256 != unbroken.rows[1].output_sha256
    assert mismatched(result.rows) == ["slots=0/pinned", "slots=3/pinned"]
    assert _check(result) == 1


def test_a_row_that_skips_a_copy_is_flagged(sim: Backend, tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With slots, one expert tensor's copy of the timed prefill is not made: its split reads the
    bytes an earlier copy left in the slot."""
    unbroken = _run(sim, tiny_path)
    real_run, real_copy = Scheduler.run, HostRegion.enqueue_h2d
    timed: list[int] = []  # while a timed prefill with slots runs: its host copies so far
    skipped: list[int] = []

    def run(self: Scheduler, plan: Plan) -> RunStats:
        if self.slots and plan.splits[-1].name.endswith(".ub1"):
            timed.append(0)
        try:
            return real_run(self, plan)
        finally:
            timed.clear()

    def copy(self: HostRegion, stream: Stream, dst: DeviceBuffer, dst_offset: int, offset: int, nbytes: int) -> None:
        if timed:
            timed[0] += 1
            if timed[0] == 5:
                skipped.append(nbytes)
                return
        real_copy(self, stream, dst, dst_offset, offset, nbytes)

    monkeypatch.setattr(Scheduler, "run", run)
    monkeypatch.setattr(HostRegion, "enqueue_h2d", copy)
    result = _run(sim, tiny_path)
    assert len(skipped) == 1
    assert result.rows[0].output_sha256 == unbroken.rows[0].output_sha256
    assert result.rows[1].output_sha256 != unbroken.rows[1].output_sha256
    assert mismatched(result.rows) == ["slots=0/pinned", "slots=3/pinned"]
    assert _check(result) == 1


def test_a_device_that_drops_a_ubatch_before_a_host_crossing_is_flagged(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 0 (the first device) skips the second ubatch in the second timed run: the second device
    reads poison from the host rows between them, not what the first run sent."""
    _leave_out(monkeypatch, lambda scheduler, run, split: run == 2 and split.name.endswith(".L0.ub1"))
    with expertstream.backend("sim", devices=2, peer_access=False) as two_sim:
        result = _run(two_sim, tiny_path, dataclasses.replace(SETTINGS, repeats=2), devices=2)
    assert result.rows[0].crossing == "host"
    assert all(r.nonfinite == UBATCH_ROWS * _n_embd(tiny_path) for r in result.rows)
    assert _check(result) == 1


def test_soak_counts_the_rounds_that_drop_a_ubatch(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the reference and the first round, every prefill leaves out its second ubatch: each such
    round is a mismatch, not a pass on the bytes the round before left."""
    real_plan, plans = MoeRunner.prefill_plan, []

    def prefill_plan(self: MoeRunner, experts: ExpertData, ubatches: Sequence[int] | None = None) -> Plan:
        plans.append(ubatches)
        return real_plan(self, experts, [0] if len(plans) > 2 else ubatches)

    monkeypatch.setattr(MoeRunner, "prefill_plan", prefill_plan)
    with expertstream.backend("sim") as sim:
        result = soak.soak(sim.device(0), tiny_path, prefills=4, decode_steps=4, batching=Batching(32, 16, 4))
    assert len(plans) == 5
    assert result["prefill_mismatches"] == 3 and result["decode_identical"]


def test_soak_refuses_a_reference_that_left_work_out(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run, the reference too, leaves out the second ubatch: alike, but each left poison behind."""
    real_plan = MoeRunner.prefill_plan
    monkeypatch.setattr(MoeRunner, "prefill_plan", lambda self, experts, ubatches=None: real_plan(self, experts, [0]))
    with expertstream.backend("sim") as sim, pytest.raises(RuntimeError, match="non-finite"):
        soak.soak(sim.device(0), tiny_path, prefills=2, decode_steps=2, batching=Batching(32, 16, 2))


def _n_embd(tiny_path: Path) -> int:
    with MoeModel.open(tiny_path) as model:
        return model.n_embd

"""A prompt's prefill, run as often as asked: ubatch by ubatch, the full ubatches replayed from one
captured graph where the scheduler can capture them.

Issued call by call, a ubatch of the whole model is some thirty launches a layer, each costing the
host more than a small kernel costs the device: at ubatch 512 with every expert on the device the
device waits on the host. ``Prefill`` captures one full ubatch (``MoeRunner.prefill_step_plan``)
after running it once, then for each full ubatch copies its token ids and positions in, launches
the graph and copies its hidden rows out (the same bytes as the calls); a last, shorter ubatch and
each ubatch's output head run as calls. Where the step cannot be captured (graphs off, the expert
blocks alone, layer-major order, several devices, experts read from prefetch slots) the prompt runs
as one plan, as before, so the lookahead keeps copying across ubatch boundaries; why is said once in
the log and in ``why_calls``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from .._closing import Closing
from ..backends.base import Stream
from ..scheduler import Bindings, Plan, Replay, Scheduler, Split
from ..scheduler.stats import RunStats
from .runner import ROUTER, ExpertData, MoeRunner

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


def reporting(plan: Plan, progress: Progress) -> Plan:
    """``plan`` whose first split of each ubatch (its first layer's router or dense block) calls
    ``progress`` with the ubatch's label (the split name's last part) before it is enqueued.

    A KeyboardInterrupt raised there (or by Ctrl-C) stops the run between splits.
    """

    def tick(split: Split) -> Split:
        compute = split.compute

        def reported(stream: Stream, bindings: Bindings) -> None:
            progress(split.name.rsplit(".", 1)[-1])
            compute(stream, bindings)

        return dataclasses.replace(split, compute=reported)

    first = next((s.name.split(".")[:2] for s in plan.splits if s.name.startswith((f"{ROUTER}.", "dense."))), None)
    start = ".".join(first) + "." if first else None
    return Plan.of([tick(s) if start and s.name.startswith(start) else s for s in plan.splits])


class Prefill(Closing):
    """The prompt ``runner`` was sized for (``set_prompt``), run by ``run`` as often as asked.

    The graph is captured on the first run that can replay it (a prompt of two full ubatches or
    more, or any run after the first) and kept until ``close``; the experts, the scheduler and the
    runner's buffers must stay as they are meanwhile.
    """

    def __init__(self, runner: MoeRunner, scheduler: Scheduler, experts: ExpertData, *, graphs: bool = True) -> None:
        self.runner, self.scheduler, self.experts = runner, scheduler, experts
        self._replay: Replay | None = None
        self._step: Plan | None = None
        self._whole: tuple[Progress, Plan] | None = None  # the prompt as one plan, reporting to its progress
        # What a by-ubatch run issues as calls, built once, untimed: the shorter last ubatch, each head.
        self._calls: dict[int, tuple[Plan | None, Plan | None]] = {}
        self.runs = 0
        self.why_calls = self._why_calls(graphs)
        if self.why_calls is not None and graphs and self.why_calls not in _told:
            _told.add(self.why_calls)
            log.info("prefill issues its calls one by one, not a captured ubatch replayed: %s", self.why_calls)

    @property
    def path(self) -> str:
        """How full ubatches run from now on: "graph" once one is captured (the later ones replay it), else "calls"."""
        return "graph" if self._replay is not None else "calls"

    @property
    def replay_bytes(self) -> int:
        """Device bytes the captured ubatch's own scratch holds (0 where none is kept)."""
        return 0 if self._replay is None else self._replay.device_bytes

    def _why_calls(self, graphs: bool) -> str | None:
        runner = self.runner
        if not graphs:
            return "graphs are off"
        if runner.whole is None:
            return "the expert blocks alone run as one plan"
        if runner.layer_major:
            return "layer-major order runs every ubatch through a layer before the next"
        if len(runner.devices) != 1:
            return f"the layers span {len(runner.devices)} devices"
        self._step = runner.prefill_step_plan(self.experts)
        return self.scheduler.why_not_captured(self._step)

    def _by_ubatch(self) -> bool:
        """Whether this run goes ubatch by ubatch: where it can, once a replay will follow the capture."""
        if self.why_calls is not None:
            return False
        return self._replay is not None or self.runs > 0 or len(self.runner.full_ubatches()) > 1

    def warm(self, progress: Progress = lambda label: None) -> RunStats:
        """Run the first ubatch alone (and capture it where ``run`` would replay it): compiles the
        kernels and takes the scratch, so that a timed run that follows pays for neither."""
        if self.why_calls is not None or 0 not in self.runner.full_ubatches():
            return self.scheduler.run(reporting(self.runner.prefill_plan(self.experts, [0]), progress))
        progress("ub0")
        return self._first_step(0)

    def run(self, progress: Progress = lambda label: None) -> RunStats:
        """Every ubatch of the prompt, in order; returns what the scheduler did. ``progress`` hears
        each ubatch's label before it is enqueued."""
        by_ubatch = self._by_ubatch()
        self.runs += 1
        if not by_ubatch:
            if self._whole is None or self._whole[0] is not progress:  # built once per progress, untimed
                self._whole = (progress, reporting(self.runner.prefill_plan(self.experts), progress))
            return self.scheduler.run(self._whole[1])
        runner, scheduler = self.runner, self.scheduler
        stats = RunStats()
        full = set(runner.full_ubatches())
        replayed = 0
        for u in range(len(runner.batching.ubatches())):
            progress(f"ub{u}")
            alone, head = self._calls_of(u, u in full)
            if alone is not None:
                stats.add(scheduler.run(alone))
                continue
            if self._replay is None:
                stats.add(self._first_step(u))
            else:
                runner.prefill_step_in(self._replay.stream, u)
                self._replay.launch()
                runner.prefill_step_out(self._replay.stream, u)
                replayed += 1
            if head is not None:
                stats.add(scheduler.run(head))
        if replayed:
            assert self._replay is not None
            once = self._replay.finish()
            for _ in range(replayed):
                stats.add(once)
        return stats

    def _calls_of(self, u: int, full: bool) -> tuple[Plan | None, Plan | None]:
        """Ubatch ``u``'s plan where it runs as calls (a shorter one, its head included), else its head's."""
        found = self._calls.get(u)
        if found is None:
            alone = None if full else self.runner.ubatch_plan(self.experts, u)
            found = self._calls[u] = (alone, self.runner.head_plan(u) if full else None)
        return found

    def _first_step(self, u: int) -> RunStats:
        """Full ubatch ``u`` through the step plan's calls, then the step captured for the next ones."""
        assert self._step is not None
        runner, scheduler = self.runner, self.scheduler
        stream = scheduler.stream(runner.device)
        runner.prefill_step_in(stream, u)
        stats = scheduler.run(self._step)
        runner.prefill_step_out(stream, u)
        if self._replay is None:
            self._replay = scheduler.capture(self._step)
        return stats

    def close(self) -> None:
        if self._replay is not None:
            self._replay.close()
            self._replay = None


_told: set[str] = set()

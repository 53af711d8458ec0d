"""A decode step captured once and replayed per token: what the model's generation and the
benchmark's decode rows share."""

from __future__ import annotations

import logging

from ..scheduler import Plan, Replay, Scheduler
from .runner import ExpertData, MoeRunner

log = logging.getLogger(__name__)

_told: set[str] = set()


def capture_decode_step(runner: MoeRunner, scheduler: Scheduler, experts: ExpertData, what: str) -> Replay | None:
    """One decode step of ``runner`` captured for replay, or None where the scheduler cannot
    capture it (the reason in the log, once per reason; ``what`` names the run there).

    Where the runtime refuses the lookahead's second stream, the step is captured again without
    the predictions (the scheduler says so): the runner stops predicting, since nothing would copy
    what it predicts. The scheduler's own slots and scratch are freed first: the replay brings its
    own, and the steps it replays need nothing else of the scheduler's."""
    if len(runner.devices) != 1:
        reason = "the layers span several devices"
    else:
        plan = runner.decode_step_plan(experts)
        why = scheduler.why_not_captured(plan)
        if why is None:

            def without_lookahead() -> Plan:
                runner.decode_lookahead = 0
                return runner.decode_step_plan(experts)

            scheduler.release_scratch()
            return scheduler.capture(plan, replan=without_lookahead)
        reason = why
    if reason not in _told:
        _told.add(reason)
        log.info("%s: decode steps issue their calls one by one, not one captured graph: %s", what, reason)
    return None

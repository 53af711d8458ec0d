"""The scheduler: splits, the stock copy path and lookahead prefetch into device slots."""

from .plan import Bindings, ComputeFn, Input, MulMatId, Plan, Split
from .scheduler import MAX_SLOTS, Replay, Scheduler, check_slots
from .source import HostRegion, HostSource
from .stats import DeviceStats, Fallback, RunStats

__all__ = [
    "MAX_SLOTS",
    "Bindings",
    "HostRegion",
    "HostSource",
    "ComputeFn",
    "DeviceStats",
    "Fallback",
    "Input",
    "MulMatId",
    "Plan",
    "Replay",
    "RunStats",
    "Scheduler",
    "Split",
    "check_slots",
]

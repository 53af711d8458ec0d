"""The scheduler: splits, the stock copy path and the lookahead staging ring."""

from .plan import Bindings, ComputeFn, Input, MulMatId, Plan, Split
from .scheduler import MAX_SLOTS, Scheduler, check_slots
from .stats import DeviceStats, Fallback, RunStats

__all__ = [
    "MAX_SLOTS",
    "Bindings",
    "ComputeFn",
    "DeviceStats",
    "Fallback",
    "Input",
    "MulMatId",
    "Plan",
    "RunStats",
    "Scheduler",
    "Split",
    "check_slots",
]

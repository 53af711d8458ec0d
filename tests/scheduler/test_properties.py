"""Random plans under the hazard checker: any slot count, any failure point, same bytes as stock."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import expertstream
from expertstream.backends.base import Backend
from expertstream.errors import DeviceError, OutOfDeviceMemory
from expertstream.scheduler import Plan, RunStats, Scheduler

from . import plans


@dataclass(frozen=True)
class Scenario:
    n_devices: int
    n_layers: int
    prefill_share: float
    slot_sequence: tuple[int, ...]
    fail_call: int | None  # the k-th ring-side allocation (slot, event or stream) fails
    fail_kind: str
    seed: int
    resident_share: float = 0.0  # layers whose weights are device-resident (partial offload)


scenarios = st.builds(
    Scenario,
    n_devices=st.integers(1, 3),
    n_layers=st.integers(1, 7),
    prefill_share=st.sampled_from([0.0, 0.5, 0.8, 1.0]),
    slot_sequence=st.lists(st.sampled_from([0, 2, 3, 4, 8]), min_size=1, max_size=3).map(tuple),
    fail_call=st.none() | st.integers(1, 8),
    fail_kind=st.sampled_from(["alloc", "event", "stream"]),
    seed=st.integers(0, 2**31 - 1),
)


@contextmanager
def failing(backend: Backend, kind: str, call: int | None) -> Iterator[None]:
    """Make the ``call``-th ``kind`` request across all devices fail once, as a full device would."""
    if call is None:
        yield
        return
    count = {"n": 0}
    originals = []
    for device in backend.devices:
        real = getattr(device, kind)
        originals.append((device, real))

        def wrapper(*args, _real=real, _device=device, **kwargs):  # type: ignore[no-untyped-def]
            count["n"] += 1
            if count["n"] == call:
                error = OutOfDeviceMemory if kind == "alloc" else DeviceError
                raise error(f"injected failure of {kind}", call=kind, device=_device.label)
            return _real(*args, **kwargs)

        setattr(device, kind, wrapper)
    try:
        yield
    finally:
        for device, _ in originals:
            delattr(device, kind)


def run_scenario(scn: Scenario) -> None:
    rng = np.random.default_rng(scn.seed)
    with expertstream.backend("sim", devices=scn.n_devices, peer_access=False) as backend:
        specs = plans.random_specs(rng, scn.n_layers, scn.n_devices, scn.prefill_share, scn.resident_share)
        first = plans.build(backend, specs, scn.seed)
        # A second plan with other (often larger) tensors forces slot reallocation mid-sequence.
        second = plans.build(backend, plans.random_specs(rng, scn.n_layers + 1, scn.n_devices, 1.0), scn.seed + 1)
        with Scheduler(slots=0) as sched:
            for built in (first, second):
                # Every run from poisoned outputs: its digests are its own, not an earlier run's. The
                # compute streams are made here, before any injected failure.
                built.poison(sched.stream)
                sched.run(built.plan)  # the stock path reserves its scratch here
                built.check()
            with failing(backend, scn.fail_kind, scn.fail_call):
                for slots in scn.slot_sequence:
                    sched.slots = slots
                    for built in (first, second, first):
                        built.poison(sched.stream)
                        sched.run(built.plan)
                        built.check()
        first.close()
        second.close()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios)
def test_random_plans_give_the_stock_bytes_without_hazards(scn: Scenario) -> None:
    run_scenario(scn)


REGRESSIONS = [
    Scenario(1, 6, 1.0, (3,), None, "alloc", 1),
    Scenario(2, 5, 0.5, (2, 4), 2, "alloc", 2),
    Scenario(3, 7, 0.8, (8, 0, 3), 3, "event", 3),
    Scenario(1, 4, 1.0, (2,), 1, "stream", 4),
    Scenario(2, 7, 1.0, (4, 2), 5, "alloc", 5),
    Scenario(3, 3, 0.0, (3,), None, "alloc", 6),
]


@pytest.mark.parametrize("scn", REGRESSIONS, ids=lambda s: f"dev{s.n_devices}-L{s.n_layers}-slots{s.slot_sequence}")
def test_fixed_seed_regressions(scn: Scenario) -> None:
    run_scenario(scn)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios, st.sampled_from([0.3, 0.5, 0.8]))
def test_plans_with_device_resident_layers_give_the_stock_bytes(scn: Scenario, resident_share: float) -> None:
    run_scenario(dataclasses.replace(scn, resident_share=resident_share))


def test_a_rerun_that_skips_a_split_fails_the_digest_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run starts from poisoned outputs: a run that drops a split cannot pass on the digest that
    an earlier run of the same plan left."""
    real_run = Scheduler.run
    ran: list[Plan] = []

    def skipping_on_reruns(self: Scheduler, plan: Plan) -> RunStats:
        if any(plan is earlier for earlier in ran):
            return real_run(self, Plan.of(plan.splits[1:]))
        ran.append(plan)
        return real_run(self, plan)

    monkeypatch.setattr(Scheduler, "run", skipping_on_reruns)
    with pytest.raises(AssertionError, match="split 0: digest differs"):
        run_scenario(REGRESSIONS[0])

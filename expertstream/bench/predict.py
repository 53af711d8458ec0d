"""Predictions in the simulator's virtual time, and the settings `auto` picks from them.

``predict`` runs the job's own measurement (measure.py) on a timing-only simulator whose
profile describes the device (a built-in, or what `expertstream tune` wrote): the same plans,
slots, host memory and ubatches, in virtual time. ``choose`` predicts every candidate setting on
a simulated device with the real device's free memory and picks the fastest that fits.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..backends import backend as open_backend
from ..backends.sim.profiles import Profile
from ..engine.runner import Batching
from ..errors import OutOfDeviceMemory
from ..hostmem import HostMemoryMode, MemoryReader, memlimit
from ..model import MoeModel
from ..scheduler.stats import Fallback
from .measure import Measurement, Settings, measure
from .report import Row

UBATCH_CHOICES = (512, 1024, 2048, 4096)
SLOT_CHOICES = (0, 2, 3, 4)
# Host memory `auto` chooses among: the mapping registered in place (where the device can),
# a staging ring, or the mapping as it is. A pinned copy doubles the host memory a model takes,
# so it is chosen only when asked for.
MODE_CHOICES = (HostMemoryMode.REGISTERED, HostMemoryMode.RING, HostMemoryMode.MMAP)


def host_memory_choices(
    model: MoeModel, memory: MemoryReader | None = None
) -> tuple[tuple[HostMemoryMode, ...], str | None]:
    """The modes ``--host-memory auto`` predicts: MODE_CHOICES, or mode disk alone where the model's
    tensors do not fit the host memory this process may fill (``memory``; None: what
    ``memlimit.read_memory_limit`` reads), with the reason: every other mode would read their pages
    from the drive again and again, which no prediction times."""
    why = memlimit.model_too_big(model, memory)
    return (MODE_CHOICES, None) if why is None else ((HostMemoryMode.DISK,), why)


# Settings predicted within this of each other are a tie: the one that takes less device memory wins.
TIE = 0.002


def predict(
    profile: Profile, model: MoeModel, settings: Settings, memory_bytes: int | None = None, devices: int = 1
) -> Measurement:
    """What ``measure`` would report on devices ``profile`` describes (each with ``memory_bytes`` of memory).

    ``devices`` > 1 predicts the layer split over that many such devices.
    """
    if memory_bytes is not None:
        profile = dataclasses.replace(profile, memory_bytes=int(memory_bytes))
    with open_backend("sim", profile=profile, data=False, check_hazards=False, devices=devices) as sim:
        # Virtual time repeats exactly: one timed run per row (after the warm-up, which sets up
        # slots and scratch as it does on the device).
        return measure(sim, list(sim.devices), model, dataclasses.replace(settings, repeats=1))


def with_predictions(rows: Sequence[Row], predicted: Sequence[Row]) -> list[Row]:
    """``rows`` with the predicted time to first token and decode rate of the matching predicted row."""
    return [
        dataclasses.replace(row, predicted_ttft_s=p.ttft_s, predicted_decode_tokens_per_s=p.decode_tokens_per_s)
        for row, p in zip(rows, predicted, strict=True)
    ]


class Costed(Protocol):
    """What a setting's cost is made of (a Row, or measured rows read back from a file)."""

    @property
    def ttft_s(self) -> float: ...
    @property
    def decode_steps(self) -> int: ...
    @property
    def decode_tokens_per_s(self) -> float | None: ...


def seconds(row: Costed) -> float:
    """What a setting costs: the prefill, then the decode steps."""
    decode = row.decode_steps / row.decode_tokens_per_s if row.decode_steps and row.decode_tokens_per_s else 0.0
    return row.ttft_s + decode


@dataclass(frozen=True)
class Candidate:
    slots: int
    host_memory: HostMemoryMode
    ubatch: int
    seconds: float | None  # predicted; None when it does not fit
    why_not: str = ""

    @property
    def label(self) -> str:
        return f"slots {self.slots}, {self.host_memory.value}, ubatch {self.ubatch}"


@dataclass(frozen=True)
class Choice:
    """The picked setting and every candidate it was picked from."""

    best: Candidate
    candidates: tuple[Candidate, ...]
    free_bytes: int
    disk_reason: str | None = None  # why mode disk was the only host memory tried (host_memory_choices)

    @property
    def slots(self) -> int:
        return self.best.slots

    @property
    def host_memory(self) -> HostMemoryMode:
        return self.best.host_memory

    @property
    def ubatch(self) -> int:
        return self.best.ubatch

    def explain(self) -> str:
        """One line: what was picked, its prediction, the runner-up, and what did not fit."""
        assert self.best.seconds is not None
        fitting = sorted((c for c in self.candidates if c.seconds is not None), key=lambda c: c.seconds or 0.0)
        parts = [f"auto picked {self.best.label}: predicted {self.best.seconds:.4f} s"]
        others = [c for c in fitting if c is not self.best]
        if others:
            assert others[0].seconds is not None
            parts.append(f"next {others[0].label} {others[0].seconds / self.best.seconds - 1:+.1%}")
        too_big = [c for c in self.candidates if c.seconds is None]
        if too_big:
            parts.append(
                f"{len(too_big)} of {len(self.candidates)} settings do not fit in {self.free_bytes / 2**30:.1f} GiB "
                f"free (e.g. {too_big[0].label}: {too_big[0].why_not})"
            )
        if self.disk_reason is not None:
            parts.append(f"host memory disk alone: {self.disk_reason}")
        return "; ".join(parts)


def choose(
    profile: Profile,
    model: MoeModel,
    base: Settings,
    *,
    slots: Sequence[int],
    modes: Sequence[HostMemoryMode],
    ubatches: Sequence[int],
    free_bytes: int,
    devices: int = 1,
) -> Choice:
    """The fastest of every (slots, host memory, ubatch) by prediction, on devices with ``free_bytes`` each."""
    predicted = predict_candidates(
        profile, model, base, slots=slots, modes=modes, ubatches=ubatches, memory_bytes=free_bytes, devices=devices
    )
    return pick([c for by_ubatch in predicted.values() for c in by_ubatch[1]], free_bytes)


def predict_candidates(
    profile: Profile,
    model: MoeModel,
    base: Settings,
    *,
    slots: Sequence[int],
    modes: Sequence[HostMemoryMode],
    ubatches: Sequence[int],
    memory_bytes: int,
    devices: int = 1,
) -> dict[int, tuple[list[Row], list[Candidate]]]:
    """Per ubatch: the predicted rows (modes outermost, as ``measure`` orders them) and the candidates.

    A setting whose prefetch slots could not be allocated, or whose activations do not fit,
    is a candidate that does not fit; a mode the platform turned into another is left out
    (the other is a candidate of its own), except the preferred mode, which stands for the mode it
    resolves to.
    """
    out: dict[int, tuple[list[Row], list[Candidate]]] = {}
    for ubatch in ubatches:
        batching = Batching(base.batching.tokens, ubatch, base.batching.decode_steps)
        settings = dataclasses.replace(base, batching=batching, slots=tuple(slots), host_memory=tuple(modes))
        try:
            rows = predict(profile, model, settings, memory_bytes=memory_bytes, devices=devices).rows
        except OutOfDeviceMemory as exc:
            out[ubatch] = ([], [Candidate(s, m, ubatch, None, exc.detail) for m, s in itertools.product(modes, slots)])
            continue
        candidates = []
        for row, (asked, slot_count) in zip(rows, itertools.product(modes, slots), strict=True):
            # The preferred mode is the platform's to resolve: its candidate is the mode it resolved to.
            mode = HostMemoryMode(row.host_memory) if asked is HostMemoryMode.PREFERRED else asked
            if row.host_memory != mode.value:
                continue
            if row.fallbacks.get(Fallback.ALLOC_FAILED) or row.fallbacks.get(Fallback.DISABLED):
                candidates.append(Candidate(slot_count, mode, ubatch, None, "its prefetch slots cannot be allocated"))
            else:
                candidates.append(Candidate(slot_count, mode, ubatch, seconds(row)))
        out[ubatch] = (rows, candidates)
    return out


def pick(candidates: Sequence[Candidate], free_bytes: int) -> Choice:
    """The fastest candidate that fits; among those within TIE of it, the one with the fewest slots."""
    fitting = [c for c in candidates if c.seconds is not None]
    if not fitting:
        raise OutOfDeviceMemory(
            f"no candidate setting fits in {free_bytes} bytes of free device memory",
            call="prefill --slots/--ubatch auto",
            hint="free device memory, or keep some layers' experts on the host (-ncmoe)",
        )
    fastest = min(c.seconds for c in fitting if c.seconds is not None)
    near = [c for c in fitting if c.seconds is not None and c.seconds <= fastest * (1 + TIE)]
    best = min(near, key=lambda c: (c.slots, c.seconds or 0.0))
    return Choice(best, tuple(candidates), free_bytes)


def ubatch_choices(tokens: int, batch: int | None = None) -> tuple[int, ...]:
    """The ubatches `--ubatch auto` tries: up to the prompt, and dividing the logical batch when given."""
    limit = tokens if batch is None else min(tokens, batch)
    values = {min(u, limit) for u in UBATCH_CHOICES}
    if batch is not None:
        values = {u for u in values if batch % u == 0} or {limit}
    return tuple(sorted(values))

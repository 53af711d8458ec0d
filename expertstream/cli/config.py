"""One frozen run configuration per `prefill` command, resolved from its arguments before anything runs.

``RunConfig.from_args`` checks the parsed arguments once and turns every option into the value the
run uses: the model given or the one to make, each matrix axis as a tuple, host memory as modes
(``HostMemoryMode.PREFERRED`` when none is named), the staging ring's options as one
``RingOptions``. The settings that ``auto`` asks for stay marked (``Auto``) until
``RunConfig.resolve_auto`` fills them in from the prediction; the parsed arguments are never changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..backends.base import Device
from ..backends.sim.profiles import Profile
from ..bench.measure import Settings
from ..bench.predict import SLOT_CHOICES, Choice, choose, host_memory_choices, ubatch_choices
from ..engine.offload import GpuMemory
from ..engine.runner import Batching
from ..hostmem import HostMemoryMode, RingFill, RingOptions
from ..kernels.layout import MatrixPath
from ..model import MoeModel
from .tools import UsageError, decode_copies, gathers, writable_path

AUTO = "auto"
PREDICTED_MODES = "predicted"  # --host-memory auto given alone: the fastest mode by prediction


@dataclass(frozen=True)
class Auto:
    """Which settings the prediction picks (``--slots auto``, ``--ubatch auto``, ``--host-memory auto``)."""

    slots: bool = False
    ubatch: bool = False
    host_memory: bool = False

    def __bool__(self) -> bool:
        return self.slots or self.ubatch or self.host_memory


@dataclass(frozen=True)
class MadeModel:
    """The model a run makes when no file is given."""

    preset: str = "tiny"
    qtype: str = "Q4_0"
    layers: int | None = None


@dataclass(frozen=True)
class RunConfig:
    """Everything a `prefill` run does, each option resolved (auto ones by ``resolve_auto``)."""

    backend: str
    devices: tuple[int, ...]
    model_path: str | None  # a GGUF file, or None: make ``made``
    made: MadeModel
    tokens: tuple[int, ...]
    decode: tuple[int, ...]
    batch: tuple[int, ...] | None  # logical batches (-b), where given
    ubatch: tuple[int, ...]  # empty while auto picks it
    slots: tuple[int, ...]  # empty while auto picks them
    host_memory: tuple[HostMemoryMode, ...]  # empty while auto picks it
    n_cpu_moe: tuple[int | None, ...]  # -ncmoe's values (None: all); empty when not given
    gpu_memory: GpuMemory | None
    host_cache: int | None  # host memory disk's RAM tier, bytes
    ring: RingOptions
    matrix_path: MatrixPath | None  # None: each expert type's default
    direct: bool
    gemv: bool
    fuse_gate_up: bool
    decode_lookahead: int | None
    experts_only: bool
    prefill_order: str | None  # None: bench.measure.default_prefill_order
    decode_copies: str  # gather, dma, or auto until resolve_decode_copies settles it (tools.DECODE_COPIES)
    graphs: bool
    repetitions: int
    seed: int
    predict: str | None  # a profile file, "" for the backend's own (or one tuned now), None: no prediction
    sim_profile: str | None
    timing_only: bool
    output_format: str
    trace: Path | None
    command_line: str
    auto: Auto = Auto()
    choice: Choice | None = None  # what the prediction picked for ``auto``, once resolved

    @classmethod
    def from_args(cls, args: argparse.Namespace, command_line: str) -> RunConfig:
        """Check the parsed arguments and resolve every option but the automatic ones; raise UsageError."""
        if args.model is not None and args.model_flag is not None:
            raise UsageError("give the model once: as MODEL or as -m, not both")
        model_path = args.model if args.model is not None else args.model_flag
        made_flags = (("--preset", args.preset), ("--type", args.qtype), ("--layers", args.layers))
        given = [flag for flag, value in made_flags if value is not None]
        if model_path is not None and given:
            raise UsageError(
                f"{', '.join(given)} describe a model to make; with a model file ({model_path}) leave them out"
            )
        modes = [m for m in (args.host_memory, args.load_mode, (HostMemoryMode.PINNED,) if args.no_mmap else None) if m]
        if len(modes) > 1:
            raise UsageError("choose host memory once: --host-memory, -lm or --no-mmap")
        host_memory = modes[0] if modes else (HostMemoryMode.PREFERRED,)
        auto = Auto(slots=args.slots == AUTO, ubatch=args.ubatch == AUTO, host_memory=host_memory == PREDICTED_MODES)
        if auto and any(len(values or ()) > 1 for values in (args.tokens, args.decode, args.batch, args.n_cpu_moe)):
            raise UsageError(
                "auto picks one setting for one prompt: give one -p, one -n and at most one -b and one -ncmoe"
            )
        if args.json and args.output_format not in ("text", "json"):  # text: -o's default, not a choice
            raise UsageError(f"--json and -o {args.output_format} ask for two formats: give one")
        if args.experts_only and args.prefill_order == "layer":
            raise UsageError("layer-major prefill runs the whole model: leave out --experts-only")
        if args.gpu_memory is not None and args.n_cpu_moe:
            raise UsageError("-ncmoe and --gpu-memory both choose which layers stream: give one of them")
        _check_host_cache(args.host_cache, host_memory)
        config = cls(
            backend=args.backend,
            devices=args.device,
            model_path=model_path,
            made=MadeModel(args.preset or "tiny", args.qtype or "Q4_0", args.layers),
            tokens=args.tokens,
            decode=args.decode,
            batch=args.batch,
            ubatch=() if auto.ubatch else args.ubatch,
            slots=() if auto.slots else args.slots,
            host_memory=() if auto.host_memory else host_memory,
            n_cpu_moe=tuple(None if value == "all" else int(value) for value in args.n_cpu_moe or ()),
            gpu_memory=args.gpu_memory,
            host_cache=args.host_cache,
            ring=RingOptions(
                fill=RingFill(args.ring_fill),
                threads=args.ring_threads,
                chunks=args.ring_chunks,
                chunk_bytes=None if args.ring_chunk_mib is None else args.ring_chunk_mib << 20,
                part_bytes=None if args.ring_part_mib is None else args.ring_part_mib << 20,
            ),
            matrix_path=None if args.matrix_path == AUTO else MatrixPath(args.matrix_path),
            direct=not args.no_direct,
            gemv=args.gemv,
            fuse_gate_up=args.fuse_gate_up,
            decode_lookahead=args.decode_lookahead,
            experts_only=args.experts_only,
            prefill_order=args.prefill_order,
            decode_copies=decode_copies(args),
            graphs=not args.no_graphs,
            repetitions=args.repetitions,
            seed=args.seed,
            predict=args.predict,
            sim_profile=args.sim_profile,
            timing_only=args.timing_only,
            output_format="json" if args.json else args.output_format,
            trace=None if args.trace is None else writable_path(args.trace, "--trace"),
            command_line=command_line,
            auto=auto,
        )
        if not auto.ubatch:
            config.batchings()  # refuse a bad -b / -ub pair before anything is made or opened
        return config

    @property
    def streamed_layer_settings(self) -> tuple[int | None, ...]:
        """The -ncmoe values to run: None streams every layer (or what --gpu-memory decides)."""
        return self.n_cpu_moe or (None,)

    @property
    def needs_profile(self) -> bool:
        """Whether the run predicts: beside each row (--predict), or to pick the automatic settings."""
        return self.predict is not None or bool(self.auto)

    def batchings(self) -> list[tuple[Batching, int | None]]:
        """Every (prompt, batch, ubatch, decode) combination, with the logical batch where -b was given."""
        out: list[tuple[Batching, int | None]] = []
        for tokens, batch, ubatch, decode in itertools.product(
            self.tokens, self.batch or (None,), self.ubatch, self.decode
        ):
            effective = ubatch if batch is None else min(ubatch, batch)
            if batch is not None and batch % effective:
                raise UsageError(f"-b {batch} is not a multiple of -ub {ubatch}: ubatches would not tile the batch")
            out.append((Batching(tokens, effective, decode), batch))
        return out

    def settings(self, batching: Batching, n_cpu_moe: int | None) -> Settings:
        """The measurement of one batching and -ncmoe value (None: every layer streams, or what
        gpu_memory decides): every slot count and host memory mode."""
        return Settings(
            batching,
            self.slots,
            self.host_memory,
            self.seed,
            repeats=self.repetitions,
            ring=self.ring,
            n_cpu_moe=n_cpu_moe,
            gpu_memory=self.gpu_memory,
            host_cache=self.host_cache,
            matrix_path=self.matrix_path,
            direct=self.direct,
            gemv=self.gemv,
            fuse_gate_up=self.fuse_gate_up,
            decode_lookahead=self.decode_lookahead,
            whole=not self.experts_only,
            prefill_order=self.prefill_order,
            gather=gathers(self.decode_copies, None),
            graphs=self.graphs,
        )

    def runs(self) -> list[tuple[Settings, int | None]]:
        """Every row group to measure, with its logical batch where -b was given."""
        return [
            (self.settings(batching, n_cpu_moe), batch)
            for (batching, batch), n_cpu_moe in itertools.product(self.batchings(), self.streamed_layer_settings)
        ]

    def resolve_decode_copies(self, profile: Profile | None) -> RunConfig:
        """This configuration with --decode-copies auto settled: the choice `tune` recorded in ``profile``,
        else the device's gather."""
        return dataclasses.replace(self, decode_copies="gather" if gathers(self.decode_copies, profile) else "dma")

    def resolve_auto(self, profile: Profile, model: MoeModel, devices: Sequence[Device]) -> RunConfig:
        """This configuration with the automatic settings picked by prediction on these devices."""
        tokens, decode = self.tokens[0], self.decode[0]
        batch = self.batch[0] if self.batch else None
        modes, disk_reason = host_memory_choices(model) if self.auto.host_memory else (self.host_memory, None)
        choice = choose(
            profile,
            model,
            self.settings(Batching(tokens, min(tokens, 512), decode), self.streamed_layer_settings[0]),
            slots=SLOT_CHOICES if self.auto.slots else self.slots,
            modes=modes,
            ubatches=ubatch_choices(tokens, batch) if self.auto.ubatch else self.ubatch,
            free_bytes=min(d.free_memory() for d in devices),
            devices=len(devices),
        )
        choice = dataclasses.replace(choice, disk_reason=disk_reason)
        return dataclasses.replace(
            self,
            slots=(choice.slots,) if self.auto.slots else self.slots,
            host_memory=(choice.host_memory,) if self.auto.host_memory else self.host_memory,
            ubatch=(choice.ubatch,) if self.auto.ubatch else self.ubatch,
            choice=choice,
        )


def _check_host_cache(host_cache: int | None, host_memory: tuple[HostMemoryMode, ...] | str) -> None:
    """--host-cache is a RAM tier of mode disk: every row it applies to must read from disk."""
    if host_cache is None or host_memory == (HostMemoryMode.DISK,):
        return
    given = host_memory if isinstance(host_memory, str) else ",".join(m.value for m in host_memory)
    raise UsageError(
        f"--host-cache is a RAM tier of --host-memory disk, not of {given}: give --host-memory disk with it, "
        "or leave --host-cache out"
    )

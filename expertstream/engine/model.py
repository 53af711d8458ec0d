"""A GGUF MoE model run end to end: token ids in, logits and text out, experts streamed.

``Model.open(path, backend=...)`` maps the file, builds its tokenizer, places the expert
tensors in host memory and checks that the architecture runs whole (hparams.py). ``logits``
gives the next-token logits of every position of a token sequence; ``generate`` yields tokens
and their text as they are produced. Each call runs on a ``MoeRunner`` sized for its tokens
(weights other than the experts, KV cache, activations), through the scheduler's lookahead
with ``slots`` prefetch slots; the last runner is kept for the next call of the same shape.
Device-resident experts (``n_cpu_moe``, ``gpu_memory``) are uploaded once, on the first call,
and kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from .._closing import Closing
from ..backends import backend as open_backend
from ..backends.base import Backend, Device
from ..errors import InvalidArgument
from ..hostmem import HostMemoryMode, HostWeights
from ..kernels.layout import MatrixPath
from ..model import MoeModel
from ..scheduler import Replay, Scheduler
from .decoding import capture_decode_step
from .hparams import Transformer
from .offload import GpuMemory, ResidentExperts, plan_offload
from .prefill import Prefill
from .runner import Batching, ExpertData, MoeRunner, check_prefill_order, prefers_layer_major
from .sampling import Sampler, Sampling
from .tokenizer import Tokenizer
from .uploads import DeviceMemory


@dataclass(frozen=True)
class Options:
    """How a model runs: batching, context, prefetch, host memory and offload."""

    ubatch: int = 512
    n_ctx: int | None = None  # None: what each call needs (its prompt and generation)
    slots: int = 3
    host_memory: HostMemoryMode | str = HostMemoryMode.PREFERRED
    n_cpu_moe: int | None = None  # with gpu_memory None too: every layer's experts stream
    gpu_memory: GpuMemory | None = None
    host_cache: int | None = None  # host memory disk: bytes of RAM for the first layers' experts (HostWeights.open)
    matrix_path: MatrixPath | None = None
    fuse_gate_up: bool = False
    prefill_order: str = "auto"  # "layer", "ubatch" or "auto" (layer-major where the prompt's rows fit)
    # decode steps, and a prompt's full ubatches, replayed from one captured graph where the scheduler can
    graphs: bool = True
    gemv: bool = True  # decode's few rows on the matrix-vector kernels (MoeKernels.gemv)
    # decode's expert rows from page-locked memory copied by the device itself (Scheduler.gather);
    # False: DMAs enqueued after the routing ids are read back, the same bytes
    gather: bool = True
    # decode: the experts of each streamed layer its router ranks first on the layer before's FFN
    # input, this many of them, copied while the layer before computes (MoeRunner.decode_lookahead,
    # Scheduler.decode_lookahead); None: half the experts a token uses; 0: off. The same bytes.
    decode_lookahead: int | None = None

    def __post_init__(self) -> None:
        check_prefill_order(self.prefill_order)
        if self.ubatch < 1:
            raise InvalidArgument(f"ubatch must be >= 1, got {self.ubatch}")
        if self.gpu_memory is not None and self.n_cpu_moe is not None:
            raise InvalidArgument(
                "n_cpu_moe (-ncmoe) and gpu_memory (--gpu-memory) both choose which layers stream",
                hint="give one of them",
            )


@dataclass(frozen=True)
class Generated:
    """One generated token and the text it completes (empty while a character is still partial)."""

    token: int
    text: str


class Model(Closing):
    """A whole MoE model on one device (or several: ``devices``), experts streamed from host memory."""

    def __init__(
        self, model: MoeModel, backend: Backend, devices: Sequence[Device], options: Options, stack: ExitStack
    ) -> None:
        self.model = model
        self.backend = backend
        self.devices = tuple(devices)
        self.options = options
        self.transformer = Transformer.read(model)
        self.tokenizer = Tokenizer.from_model(model)
        self._stack = stack
        self.weights = stack.enter_context(
            HostWeights.open(model, self.devices[0], options.host_memory, host_cache=options.host_cache)
        )
        self._resident: ResidentExperts | None = None
        self._run: _Run | None = None
        self.last_stats: dict[str, float] = {}
        # What the last generation held on the devices, by kind (staging: the most at once).
        self.device_memory = DeviceMemory()
        self.decode_path = ""  # how the last generation's decode steps ran: "graph" (one step replayed) or "calls"
        # predicted experts per streamed layer the last generation's decode steps copied ahead (0: none)
        self.decode_lookahead = 0
        self.prefill_path = ""  # how its prompt's full ubatches ran: "graph" (one ubatch replayed) or "calls"

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        backend: Backend | str = "auto",
        devices: Sequence[int] = (0,),
        options: Options | None = None,
        **settings: object,
    ) -> Model:
        """Open the model at ``path`` on ``backend`` (a Backend, or a name for ``expertstream.backend``).

        ``settings`` are fields of ``Options`` (ubatch, n_ctx, slots, host_memory, ...). ModelError
        names the file and what is wrong; an architecture not run whole yet is refused here.
        """
        known = {f.name for f in fields(Options)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise InvalidArgument(
                f"unknown option {', '.join(map(repr, unknown))} for Model.open",
                hint=f"options: {', '.join(sorted(known))}",
            )
        chosen = replace(options or Options(), **settings)  # type: ignore[arg-type]
        with ExitStack() as stack:
            if isinstance(backend, str):
                backend = stack.enter_context(open_backend(backend))
            model = stack.enter_context(MoeModel.open(path))
            found = [backend.device(i) for i in devices]
            opened = cls(model, backend, found, chosen, stack)  # a refusal here closes what the stack holds
            opened._stack = stack.pop_all()
        return opened

    # -- running ----------------------------------------------------------------------------
    def logits(self, tokens: Sequence[int], *, prompt: int | None = None) -> np.ndarray:
        """float32 [len(tokens), n_vocab]: the next-token logits after each position of ``tokens``.

        The first ``prompt`` tokens (default: all) run as one prefill; each later one runs as a
        decode step of its own, as generation feeds them: how a check holds decode to a reference.
        """
        ids = self._check_tokens(tokens, 0)
        n_prompt = len(ids) if prompt is None else prompt
        if not 1 <= n_prompt <= len(ids):
            raise InvalidArgument(f"prompt must be 1..{len(ids)} tokens of the sequence, got {n_prompt}")
        steps = len(ids) - n_prompt
        with self._runner(n_prompt, steps, all_logits=True) as (runner, scheduler, experts, prefill):
            runner.set_prompt(ids[:n_prompt])
            prefill.run()
            self.prefill_path = prefill.path
            rows = [runner.prompt_logits()]
            for step in range(steps):
                runner.set_decode_token(step, int(ids[n_prompt + step]))
                scheduler.run(runner.decode_plan(experts, step))
                rows.append(runner.decode_logits(step)[None, :])
        return np.concatenate(rows)

    def generate(
        self, prompt: str | Sequence[int], max_tokens: int = 64, sampling: Sampling | None = None
    ) -> Iterator[Generated]:
        """Tokens after ``prompt`` (text, tokenized with the file's vocabulary, or token ids), until
        an end-of-generation token or ``max_tokens``. Greedy where ``sampling.temperature`` is 0.

        Bad input (an empty prompt, one that does not fit the context, bad sampling settings) raises
        InvalidArgument here, before the iterator is returned and anything is computed."""
        if max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {max_tokens}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        ids = list(self._check_tokens(ids, max_tokens - 1))
        return self._generated(ids, max_tokens, Sampler(sampling or Sampling()))

    def _generated(self, ids: list[int], max_tokens: int, sampler: Sampler) -> Iterator[Generated]:
        self.last_stats = {"seed": sampler.seed, "prompt_tokens": len(ids)}
        with self._runner(len(ids), max_tokens - 1, all_logits=False) as (runner, scheduler, experts, prefill):
            host = self.backend.host
            start = host.timestamp()
            runner.set_prompt(ids)
            prefill.run()
            self.prefill_path = prefill.path
            logits = runner.prompt_logits()[-1]
            self.last_stats["prompt_s"] = host.timestamp() - start
            prompt_staging = scheduler.device_bytes() + prefill.replay_bytes
            text = _TextStream(self.tokenizer)
            start = host.timestamp()
            with _DecodeSteps(runner, scheduler, experts, self.options.graphs) as steps:
                for step in range(max_tokens):
                    token = sampler(logits)
                    self.last_stats["generated"] = step + 1
                    yield Generated(token, text.push(token))
                    if token == self.tokenizer.eos_id or step == max_tokens - 1:
                        break
                    logits = steps.run(step, token)
                    self.last_stats["decode_s"] = host.timestamp() - start
            self.decode_path = steps.path
            self.decode_lookahead = runner.decode_lookahead if steps.ahead else 0
            staging = max(prompt_staging, steps.most_held + prefill.replay_bytes)  # the most at once
            resident = self._resident.device_bytes if self._resident is not None else 0
            self.device_memory = runner.device_memory() + DeviceMemory(resident_experts=resident, staging=staging)

    def _check_tokens(self, tokens: Sequence[int], generate: int) -> np.ndarray:
        ids = np.asarray(list(tokens), dtype=np.int64)
        if ids.size == 0:
            raise InvalidArgument("the prompt is empty: give at least one token")
        n_ctx = self.options.n_ctx
        if n_ctx is not None and ids.size + generate > n_ctx:
            raise InvalidArgument(
                f"the prompt ({ids.size} tokens) and {generate} tokens fed back while generating do not fit the "
                f"context of {n_ctx}",
                hint="raise the context (-c) or shorten the prompt",
            )
        return ids

    def _layer_major(self, tokens: int) -> bool:
        batching = Batching(tokens, self.options.ubatch)
        streams = self.options.n_cpu_moe != 0  # with n_cpu_moe 0 every expert stays on the device
        return prefers_layer_major(self.options.prefill_order, self.model, batching, self.devices, streams=streams)

    def _runner(self, tokens: int, steps: int, *, all_logits: bool) -> _Run:
        """The run of this shape: the last one where it has the shape, else a new one (the last closed)."""
        key = (tokens, steps, all_logits)
        if self._run is not None and self._run.busy:  # a generation still open uses it: this call gets its own
            return _Run(self, tokens, steps, all_logits, kept=False)
        if self._run is None or self._run.key != key:
            self._forget_run()
            self._run = _Run(self, tokens, steps, all_logits)
        return self._run

    def _forget_run(self) -> None:
        if self._run is not None:
            self._run.close()
            self._run = None

    def resident_experts(self, runner: MoeRunner) -> ResidentExperts:
        """The device-resident experts (none unless n_cpu_moe or gpu_memory say so), uploaded once."""
        if self._resident is None:
            options = self.options
            plan = plan_offload(
                self.model,
                runner.layer_split,
                n_cpu_moe=options.n_cpu_moe,
                gpu_memory=options.gpu_memory,
                slots=options.slots,
                host_inputs_per_split=2 if runner.fuses_gate_up() else 1,
                lookahead_inputs=runner.lookahead_inputs,
                lookahead_rows=runner.lookahead_rows,
                in_use={d: runner.device_bytes_on(d) for d in runner.layer_split.devices},
            )
            self._resident = self._stack.enter_context(
                ResidentExperts(self.model, runner.layer_split, plan, upload_data=runner.data)
            )
        return self._resident

    def close(self) -> None:
        self._forget_run()
        self._stack.close()


class _Run:
    """A runner, a scheduler and the expert data for calls of one shape (prompt tokens, decode steps,
    which logits): ``with model._runner(...) as (runner, scheduler, experts, prefill)``.

    The model keeps the last one and hands it to the next call of the same shape (perplexity's chunks,
    repeated generations of one length), so its weights, KV cache and kernels are not set up again;
    a call of another shape closes it first. A call that fails closes it too.
    """

    def __init__(self, model: Model, tokens: int, steps: int, all_logits: bool, *, kept: bool = True) -> None:
        self.model = model
        self.key = (tokens, steps, all_logits)
        self.kept = kept  # the model keeps it for the next call; else it closes when the call ends
        self.busy = False
        self._stack = ExitStack()
        self._parts: tuple[MoeRunner, Scheduler, ExpertData, Prefill] | None = None

    def open(self) -> tuple[MoeRunner, Scheduler, ExpertData, Prefill]:
        if self._parts is not None:
            return self._parts
        m, options = self.model, self.model.options
        tokens, steps, all_logits = self.key
        try:
            runner = self._stack.enter_context(
                MoeRunner(
                    m.devices,
                    m.model,
                    Batching(tokens, options.ubatch, steps),
                    matrix_path=options.matrix_path,
                    fuse_gate_up=options.fuse_gate_up,
                    decode_lookahead=options.decode_lookahead,
                    gemv=options.gemv,
                    transformer=m.transformer,
                    n_ctx=options.n_ctx,
                    layer_major=m._layer_major(tokens),
                    all_logits=all_logits,
                )
            )
            experts = m.resident_experts(runner).experts(m.weights)
            scheduler = self._stack.enter_context(Scheduler(slots=options.slots, gather=options.gather))
            prefill = self._stack.enter_context(Prefill(runner, scheduler, experts, graphs=options.graphs))
        except BaseException:
            self.close()
            raise
        self._parts = (runner, scheduler, experts, prefill)
        return self._parts

    def __enter__(self) -> tuple[MoeRunner, Scheduler, ExpertData, Prefill]:
        parts = self.open()
        self.busy = True
        return parts

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.busy = False
        if not self.kept:
            self.close()
        elif kind is not None:  # a failed call may leave work half done: the next call starts afresh
            self.model._forget_run()

    def close(self) -> None:
        self._parts = None
        self._stack.close()


class _DecodeSteps:
    """Decode steps of one generation: the first through the scheduler, the rest replayed from one
    captured step where the scheduler can capture it (``Options.graphs``), with the same bytes."""

    def __init__(self, runner: MoeRunner, scheduler: Scheduler, experts: ExpertData, graphs: bool) -> None:
        self.runner, self.scheduler, self.experts, self.graphs = runner, scheduler, experts, graphs
        self._replay: Replay | None = None
        self.path = "calls"
        self.ahead = False  # whether a step copied predicted experts ahead (Scheduler.decode_lookahead)
        self.most_held = 0  # the most device bytes the steps' copies held at once (scheduler or replay)
        scheduler.release_scratch()  # the prompt's slots and scratch: the steps need their own

    def __enter__(self) -> _DecodeSteps:
        return self

    def run(self, step: int, token: int) -> np.ndarray:
        """Feed ``token`` as decode step ``step``; its logits."""
        runner = self.runner
        runner.set_decode_token(step, token)
        if self._replay is None:
            stats = self.scheduler.run(runner.decode_plan(self.experts, step))
            self.most_held = max(self.most_held, self.scheduler.device_bytes())
            self._replay = self._capture() if step == 0 else None
            if self._replay is not None:
                self.most_held = max(self.most_held, self._replay.device_bytes)
        else:
            replay = self._replay
            runner.decode_step_in(replay.stream, step)
            replay.launch()
            runner.decode_step_out(replay.stream, step)
            stats = replay.finish()
        self.ahead = self.ahead or stats.total("lookahead_gathers") > 0
        return runner.decode_logits(step)

    def _capture(self) -> Replay | None:
        """After the first step (kernels compiled, scratch grown): one step captured, or None (said once)."""
        if not self.graphs or self.runner.batching.decode_steps < 2:
            return None
        replay = capture_decode_step(self.runner, self.scheduler, self.experts, "generate")
        if replay is not None:
            self.path = "graph"
        return replay

    def __exit__(self, *exc: object) -> None:
        if self._replay is not None:
            self._replay.close()


class _TextStream:
    """The text of generated tokens, handed out as it completes (a character split over tokens waits)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence so far
            return ""
        piece, self.shown = text[self.shown :], len(text)
        return piece

"""Files from anywhere: every mutated GGUF file either loads or raises ModelError.

Seeds are small models the project's writer makes (single files of several architectures and
a split model); each mutation class (tests/model/fuzz.py) damages one file of a seed. For every
case the loader must either open the model, with every tensor inside its file, or raise a
ModelError naming the file; any other exception, a case that takes more than a few seconds of
CPU time, or an allocation beyond a fixed bound (an address-space limit while the cases run)
fails the test with the case that caused it. The cases are a fixed sequence: ``nox -s tests`` runs
the first FUZZ_FILES (default 1,000) of it, ``nox -s fuzz`` 10,000 or more. Besides them, every file
of every seed is cut at each boundary of its structure and one byte either side (about 6,000
files), each of which must be refused.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import signal
import sys
import traceback
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from expertstream.engine.arch import ARCHS, ffn_config
from expertstream.errors import ExpertStreamError
from expertstream.ggml import row_size
from expertstream.model import ModelError, MoeModel, get_preset, make_model

from . import fuzz

FUZZ_SEED = 13
FUZZ_FILES = int(os.environ.get("EXPERTSTREAM_FUZZ_FILES", "1000"))
CASE_SECONDS = 5  # CPU seconds, far beyond any honest case: one this slow loops on a declared count
ADDRESS_SPACE_MARGIN = 1 << 30  # no case may allocate this much
SEED_ARRAY_ITEMS = 6  # the writer's vocabulary arrays, cut short: the same structure, parsed 40x faster
TRACE_EVERY = 25  # measure the allocation peak of every 25th case with tracemalloc
SEED_PRESETS = (("tiny", "Q8_0"), ("tiny-deepseek2", "Q4_0"), ("tiny-gpt-oss", "MXFP4"), ("tiny-mixtral", "Q5_1"))


@dataclass(frozen=True)
class Seed:
    name: str
    paths: tuple[Path, ...]  # every file of the model; the first is the one to open
    maps: tuple[fuzz.FileMap, ...]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> list[Seed]:
    folder = tmp_path_factory.mktemp("seeds")
    out = []
    for preset_name, qtype in SEED_PRESETS:
        preset = dataclasses.replace(get_preset(preset_name), n_embd=64, n_ff_exp=32, n_vocab=260)
        path = make_model(preset, qtype, folder / f"{preset_name}.gguf", seed=1)
        fuzz.shorten_arrays(path, SEED_ARRAY_ITEMS)
        out.append(Seed(preset_name, (path,), (fuzz.map_file(path),)))
    preset = dataclasses.replace(get_preset("tiny"), n_embd=64, n_ff_exp=32, n_vocab=260)
    first = make_model(preset, "Q8_0", folder / "split.gguf", seed=2, split_max_tensors=10)
    shards = tuple(sorted(folder.glob("split-*-of-*.gguf")))
    assert shards[0] == first and len(shards) == 3
    fuzz.shorten_arrays(first, SEED_ARRAY_ITEMS)
    out.append(Seed("split", shards, tuple(fuzz.map_file(p) for p in shards)))
    return out


class _TookTooLong(BaseException):
    """Raised into a case that ran past CASE_SECONDS (a BaseException: no handler may swallow it)."""


@contextmanager
def _cpu_time_limit(seconds: int) -> Iterator[None]:
    """Raise _TookTooLong into the block once it has used ``seconds`` of CPU time (not wall time)."""

    def expire(signum: int, frame: object) -> None:
        raise _TookTooLong(f"still running after {seconds} s of CPU time")

    previous = signal.signal(signal.SIGPROF, expire)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


@contextmanager
def _bounded_address_space(margin: int) -> Iterator[None]:
    """Cap this process's address space at its current size plus ``margin`` (Linux)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    in_use = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = in_use + margin
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _use(model: MoeModel) -> None:
    """What a caller does with a model it opened: every tensor must lie inside its own file."""
    sizes = [p.stat().st_size for p in model.paths]
    for info in model.tensors.values():
        assert 0 <= info.offset <= info.end <= sizes[info.shard], f"{info.name} reaches outside its file"
        assert info.nbytes == row_size(info.qtype, info.ne0) * math.prod(info.ne[1:]), info.name
        assert model.raw(info).nbytes == info.nbytes
    model.summary()
    if model.arch in ARCHS:
        ffn_config(model.arch, model.metadata, str(model.path))


@dataclass
class Tally:
    loaded: int = 0
    refused: Counter[str] = dataclasses.field(default_factory=Counter)
    traced_peak: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)


def _run_case(seed: Seed, mutation: str, index: int, folder: Path, tally: Tally) -> None:
    rng = np.random.default_rng([FUZZ_SEED, index])
    shard = int(rng.integers(len(seed.paths)))
    data, what = fuzz.MUTATIONS[mutation](seed.maps[shard], rng)
    case = f"case {index}: {seed.name}, file {shard + 1} of {len(seed.paths)}, {mutation}: {what}"
    paths = [folder / p.name for p in seed.paths]
    for i, (source, target) in enumerate(zip(seed.paths, paths, strict=True)):
        # A new inode each time: a mapping of the previous case's file may still be alive.
        target.unlink(missing_ok=True)
        target.write_bytes(data if i == shard else source.read_bytes())
    traced = index // len(fuzz.MUTATIONS) % TRACE_EVERY == 0
    if traced:
        tracemalloc.start()
    try:
        with _cpu_time_limit(CASE_SECONDS), MoeModel.open(paths[0]) as model:
            _use(model)
        tally.loaded += 1
    except ModelError as exc:
        message = str(exc)
        if str(paths[0].parent) not in message:
            tally.failures.append(f"{case}: the ModelError names no file: {message}")
        tally.refused[_problem(message, folder)] += 1
    except ExpertStreamError as exc:  # a typed error from using the model (the runner's key checks)
        tally.refused[f"{type(exc).__name__}: {_problem(str(exc), folder)}"] += 1
    except (Exception, _TookTooLong) as exc:
        trace = "".join(traceback.format_exception(exc)[-3:])
        tally.failures.append(f"{case}: {type(exc).__name__}: {exc}\n{trace}")
    finally:
        if traced:
            tally.traced_peak = max(tally.traced_peak, tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()


def _problem(message: str, folder: Path) -> str:
    """The kind of refusal: the message without the file name and numbers."""
    text = message.replace(str(folder) + "/", "")
    text = text.split(": ", 1)[-1]
    return "".join("#" if c.isdigit() else c for c in text)[:70]


@pytest.mark.skipif(sys.platform != "linux", reason="the memory bound uses Linux's address-space limit")
@pytest.mark.parametrize("mutation", sorted(fuzz.MUTATIONS))
def test_mutated_files_load_or_raise_model_error(
    seeds: list[Seed], mutation: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    classes = sorted(fuzz.MUTATIONS)
    offset = classes.index(mutation)
    indices = range(offset, FUZZ_FILES, len(classes))  # case i belongs to class i mod the class count
    tally = Tally()
    with _bounded_address_space(ADDRESS_SPACE_MARGIN):
        for index in indices:
            _run_case(seeds[index // len(classes) % len(seeds)], mutation, index, tmp_path, tally)
    with capsys.disabled():
        top = ", ".join(f"{n}x {p!r}" for p, n in tally.refused.most_common(3))
        print(
            f"\n{mutation}: {len(indices)} files, {tally.loaded} loaded, {sum(tally.refused.values())} refused "
            f"({len(tally.refused)} kinds; most often {top}), peak traced allocation {tally.traced_peak} bytes"
        )
    assert not tally.failures, f"{len(tally.failures)} of {len(indices)} cases escaped:\n" + "\n".join(
        tally.failures[:5]
    )
    assert tally.traced_peak < 64 << 20


@pytest.mark.skipif(sys.platform != "linux", reason="the memory bound uses Linux's address-space limit")
def test_every_cut_at_a_structural_boundary_is_refused(
    seeds: list[Seed], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each file of each seed cut at every boundary of its structure, and one byte either side."""
    tally = Tally()
    cuts = 0
    with _bounded_address_space(ADDRESS_SPACE_MARGIN):
        for seed in seeds:
            for shard, fmap in enumerate(seed.maps):
                targets = [tmp_path / p.name for p in seed.paths]
                for source, target in zip(seed.paths, targets, strict=True):
                    target.unlink(missing_ok=True)
                    target.write_bytes(source.read_bytes())
                for cut in sorted(
                    {c for b in fmap.boundaries[:-1] for c in (b - 1, b, b + 1) if 0 <= c < len(fmap.data)}
                ):
                    targets[shard].unlink()
                    targets[shard].write_bytes(fmap.data[:cut])
                    cuts += 1
                    try:
                        with _cpu_time_limit(CASE_SECONDS), MoeModel.open(targets[0]) as model:
                            _use(model)
                        tally.failures.append(f"{seed.name} file {shard + 1} cut at {cut}: loaded")
                    except ModelError as exc:
                        if str(tmp_path) not in str(exc):
                            tally.failures.append(f"{seed.name} file {shard + 1} cut at {cut}: names no file: {exc}")
                    except (Exception, _TookTooLong) as exc:
                        tally.failures.append(f"{seed.name} file {shard + 1} cut at {cut}: {type(exc).__name__}: {exc}")
    with capsys.disabled():
        print(f"\nevery structural boundary: {cuts} cuts, {len(tally.failures)} not refused with a ModelError")
    assert cuts > 5000
    assert not tally.failures, f"{len(tally.failures)} of {cuts} cuts:\n" + "\n".join(tally.failures[:5])

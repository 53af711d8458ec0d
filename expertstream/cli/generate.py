"""`expertstream generate` and `expertstream perplexity`: the whole model, text in and out."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..backends import ENV_VAR
from ..backends.sim.profiles import resolve_profile
from ..engine.model import Model, Options
from ..engine.offload import parse_gpu_memory, parse_size
from ..engine.perplexity import perplexity
from ..engine.sampling import Sampling
from ..engine.uploads import DeviceMemory
from ..errors import InvalidArgument
from ..hostmem import HostMemoryMode
from .tools import (
    EXIT_STATUS_HELP,
    HelpFormatter,
    add_decode_copies,
    add_decode_lookahead,
    decode_copies,
    gathers,
    option_type,
    writable_path,
    write_trace,
)


def register(subparsers: Any) -> None:
    """Add the generate and perplexity subcommands to the CLI's subparsers."""
    generate = subparsers.add_parser(
        "generate",
        help="generate text from a prompt with the whole model, experts streamed",
        description="Run a GGUF MoE model end to end on a prompt and print the text as it is produced, then "
        "prompt and generation speed.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=HelpFormatter,
    )
    _common(generate)
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", help="the prompt text")
    prompt.add_argument("-f", "--file", help="read the prompt from this file")
    generate.add_argument("-n", "--n-predict", type=_positive, default=64, help="tokens to generate (at most)")
    generate.add_argument("--temp", type=float, default=0.8, help="temperature; 0 is greedy")
    generate.add_argument("--top-k", type=int, default=40, help="keep the K most likely tokens (0: all)")
    generate.add_argument("--top-p", type=float, default=0.95, help="keep the most likely tokens up to P")
    generate.add_argument("--seed", type=int, default=None, help="seed of the draws (default: a fresh one)")
    generate.add_argument(
        "--trace",
        metavar="FILE.json",
        help="write a Chrome/Perfetto trace of every copy and kernel per stream, prefill and decode "
        "(`expertstream plot` draws it)",
    )
    generate.set_defaults(run=_generate)

    ppl = subparsers.add_parser(
        "perplexity",
        help="perplexity of a text, as llama-perplexity computes it",
        description="Cut the text's tokens into chunks of -c tokens, score the second half of each, print the "
        "running estimate per chunk and the final one (llama.cpp's llama-perplexity definition).",
        epilog=EXIT_STATUS_HELP,
        formatter_class=HelpFormatter,
    )
    _common(ppl, default_ctx=512)
    ppl.add_argument("-f", "--file", required=True, help="the text file")
    ppl.add_argument("--chunks", type=_positive, default=None, help="score at most this many chunks (default: all)")
    ppl.set_defaults(run=_perplexity)


def _common(parser: argparse.ArgumentParser, default_ctx: int | None = None) -> None:
    parser.add_argument("-m", "--model", required=True, help="a GGUF MoE model")
    parser.add_argument("--backend", default="auto", help="auto, cuda, hip or sim (auto honours $" + ENV_VAR + ")")
    parser.add_argument("--device", type=int, default=0, help="device index")
    parser.add_argument(
        "-c",
        "--ctx-size",
        type=_positive,
        default=default_ctx,
        help="context in tokens" + (" (default: the prompt and the generation)" if default_ctx is None else ""),
    )
    parser.add_argument("-ub", "--ubatch", type=_positive, default=512, help="tokens per ubatch")
    parser.add_argument("--slots", type=int, default=3, help="staging slots of the lookahead (0: stock copies)")
    parser.add_argument(
        "--host-memory",
        type=HostMemoryMode,
        default=HostMemoryMode.PREFERRED.value,
        choices=[m for m in HostMemoryMode if m.value != "auto"],
        metavar="MODE",
        help="where the experts live on the host: mmap, registered, pinned, ring, disk, preferred",
    )
    parser.add_argument(
        "--host-cache",
        type=option_type(parse_size),
        default=None,
        metavar="SIZE",
        help="with --host-memory disk: RAM for the first whole MoE layers' experts (e.g. 24G), read once, and "
        "what is left for single experts decode uses again",
    )
    parser.add_argument(
        "-ncmoe", "--n-cpu-moe", type=int, default=None, metavar="N", help="stream the experts of the first N layers"
    )
    parser.add_argument(
        "--gpu-memory", type=option_type(parse_gpu_memory), default=None, help="device memory to use (SIZE or auto)"
    )
    parser.add_argument(
        "--prefill-order",
        choices=("auto", "layer", "ubatch"),
        default="auto",
        help="layer-major (each layer's experts cross once per prompt) or ubatch-major prefill",
    )
    parser.add_argument("--fuse-gate-up", action="store_true", help="gate, up and SwiGLU in one pass where possible")
    parser.add_argument(
        "--profile",
        metavar="PROFILE.json",
        help="a profile from `expertstream tune` for this device: --decode-copies auto takes its choice",
    )
    add_decode_copies(parser, "--profile")
    add_decode_lookahead(parser)
    parser.add_argument(
        "--no-graphs",
        action="store_true",
        help="issue each decode step's and each prompt ubatch's calls instead of replaying one captured step "
        "and one captured ubatch (the same bytes)",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _options(args: argparse.Namespace) -> Options:
    return Options(
        ubatch=args.ubatch,
        n_ctx=args.ctx_size,
        slots=args.slots,
        host_memory=args.host_memory,
        n_cpu_moe=args.n_cpu_moe,
        gpu_memory=args.gpu_memory,
        host_cache=args.host_cache,
        fuse_gate_up=args.fuse_gate_up,
        prefill_order=args.prefill_order,
        graphs=not args.no_graphs,
        gather=gathers(decode_copies(args), None if args.profile is None else resolve_profile(args.profile)),
        decode_lookahead=args.decode_lookahead,
    )


def _model_path(args: argparse.Namespace) -> Path:
    path = Path(args.model)
    if not path.is_file():
        raise InvalidArgument(f"{path}: no such file", hint="give a GGUF model with -m")
    return path


def _open(args: argparse.Namespace, path: Path) -> Model:
    return Model.open(path, backend=args.backend, devices=(args.device,), options=_options(args))


def _read_text(name: str) -> str:
    try:
        return Path(name).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"{name}: not UTF-8 text") from None


def _generate(args: argparse.Namespace, command_line: str) -> int:
    path = _model_path(args)
    text = args.prompt if args.prompt is not None else _read_text(args.file)
    sampling = Sampling(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    trace = None if args.trace is None else writable_path(args.trace, "--trace")
    with _open(args, path) as model:
        pieces = model.generate(text, args.n_predict, sampling)  # bad input is refused here, before any output
        if trace is not None:
            model.backend.start_trace()
        sys.stdout.write(text)
        for piece in pieces:
            sys.stdout.write(piece.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        stats, decode_path, prefill_path = model.last_stats, model.decode_path, model.prefill_path
        memory = model.device_memory
        lookahead, gather = model.decode_lookahead, model.options.gather
        if trace is not None:
            write_trace(model.backend, model.devices[0].name, model.model.summary(), command_line, trace)
    err = sys.stderr
    prompt_s, n_prompt = stats["prompt_s"], int(stats["prompt_tokens"])
    print(f"\nseed: {int(stats['seed'])}", file=err)
    print(_timing("prompt eval", prompt_s, n_prompt, "tokens"), file=err)
    print(f"prompt ubatches: {'one captured ubatch replayed' if prefill_path == 'graph' else 'calls issued'}", file=err)
    generated = int(stats.get("generated", 0))
    decode_s = stats.get("decode_s")
    if decode_s is not None and generated > 1:
        print(_timing("eval", decode_s, generated - 1, "runs"), file=err)
        how = "one captured step replayed" if decode_path == "graph" else "calls issued per step"
        print(f"decode steps: {how}", file=err)
        copies = "the device's gather" if gather else "DMAs after reading the routing ids back"
        print(f"decode copies of streamed experts: {copies}", file=err)
        if lookahead:
            print(f"decode lookahead: {lookahead} predicted experts of each streamed layer copied ahead", file=err)
    print(_memory(memory), file=err)
    return 0


def _memory(memory: DeviceMemory) -> str:
    """What the run held on its devices, by kind, in MiB."""
    mib = {name: value / 2**20 for name, value in memory.as_dict().items()}
    parts = ", ".join(f"{_MEMORY_KINDS[name]} {mib[name]:.0f}" for name in _MEMORY_KINDS)
    return f"device memory: {mib['total']:.0f} MiB ({parts}; staging: the streamed experts' slots and scratch)"


_MEMORY_KINDS = {
    "weights": "weights",
    "kv_cache": "KV cache",
    "activations": "activations",
    "resident_experts": "resident experts",
    "staging": "staging",
}


def _timing(what: str, seconds: float, count: int, unit: str) -> str:
    """One line as llama.cpp prints its timings."""
    ms = seconds * 1e3
    return (
        f"{what:>11} time = {ms:10.2f} ms / {count:5d} {unit} ({ms / count:8.2f} ms per token, "
        f"{count / seconds:8.2f} tokens per second)"
    )


def _perplexity(args: argparse.Namespace, command_line: str) -> int:
    path = _model_path(args)
    text = _read_text(args.file)
    with _open(args, path) as model:
        tokens = model.tokenizer.encode(text)
        bos = model.tokenizer.bos_id if model.tokenizer.adds_bos else None
        print(f"{len(tokens)} tokens, chunks of {args.ctx_size}", file=sys.stderr)

        def chunk(i: int, value: float) -> None:
            print(f"[{i + 1}]{value:.4f},", end="", flush=True)

        result = perplexity(model.logits, tokens, args.ctx_size, bos, chunk, max_chunks=args.chunks)
    print(f"\nFinal estimate: PPL = {result.value:.4f} +/- {result.error:.5f}")
    return 0

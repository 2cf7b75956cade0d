"""``triflash bench``: command-line parsing and the main function.

    triflash bench                        # the seeds' workload: B=4 H=16 S=4096 D=64 fp16, both causal flags
    triflash bench --sweep                # the papers' sweep: 16k tokens, hidden 2048, S 512..16k, D 64/128
    triflash bench --mode bwd --providers triflash,sdpa-flash,fa2
    triflash bench --mode decode          # batch {1,16,64} x context {1k..128k}, contiguous and paged
    triflash bench --mode host            # host time per eager call at short shapes (what users wait for)
    triflash bench --varlen 32k:512-4k --heads 16 --headdim 128 --causal yes   # packed sequences
    triflash bench --softcap 50 --sinks --alibi   # the score variants
    python -m triflash.bench ...          # the same

Without a CUDA GPU it says so and checks the kernel in Triton's interpreter instead (no timings).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from . import interpreter, report
from . import workloads as W
from .decode import decode_providers
from .plotting import plot_results
from .providers import dense_providers, forced_provider
from .runner import DoBench, run_all, stderr_progress

DESCRIPTION = """\
Benchmark triflash against other attention implementations, side by side in one run.
Every provider is checked against a reference before it is timed; a wrong one is not timed.
With no arguments: the seeds' workload, B=4 H=16 S=4096 D=64 fp16, causal and not, forward.
Without a CUDA GPU: a correctness check in Triton's interpreter instead (no timings).
"""

EPILOG = """\
providers (fwd/bwd/fwdbwd): {dense}
providers (decode):         {decode}
Providers whose package is missing are listed as unavailable, with the reason. triflash-varlen
(flash_attn_varlen_func on the batch packed as equal-length sequences) runs only when named.
--varlen: triflash, triflash-varlen (flash_attn_varlen_func), fa2/fa3/fa4 (their flash_attn_varlen_func),
flashinfer (ragged batch) and sdpa-* (nested jagged tensors; math: not causal; no GQA); others unavailable.
--softcap/--sinks/--alibi: triflash (all three), fa2 (softcap, ALiBi), fa3 (softcap), fa4 (softcap, and
sinks on sm90+: learnable_sink); the others (SDPA, naive, flashinfer) are listed unavailable.
triflash@CHOICE forces the kernels: triflash@triton (the portable Triton kernels), triflash@NAME (a
Hopper variant, forward or backward), triflash@FWD+BWD (both); only when named (scripts/tune.py).

Outputs: a Markdown report on stdout (also OUT/results.md), every number in OUT/results.json, and PNG
figures in OUT (with matplotlib: pip install 'triflash[bench]'). Progress goes to stderr.
Exit status: 0, or 1 when triflash fails its correctness check (on the GPU or in the interpreter).
"""


def provider_names(mode: str, defaults_only: bool = False) -> list[str]:
    """Every provider of ``mode`` in table order; ``defaults_only``: those run when --providers is not
    given (opt-in ones, such as triflash-varlen, are left out)."""
    return [p.name for p in (decode_providers() if mode == "decode" else dense_providers())
            if p.default or not defaults_only]


def _version() -> str:
    import triton

    import triflash

    return f"triflash {triflash.__version__} (torch {torch.__version__}, triton {triton.__version__})"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="triflash bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=DESCRIPTION,
        epilog=EPILOG.format(dense=", ".join(provider_names("fwd")),
                             decode=", ".join(provider_names("decode"))))
    shapes = parser.add_argument_group("workload")
    shapes.add_argument("--mode", choices=W.MODES, default="fwd",
                        help="fwd, bwd (backward only), fwdbwd, decode (one query token against a "
                             "K/V cache), or host (host time per eager call: forward without and with "
                             "autograd, forward + backward, at short shapes) (default: fwd)")
    shapes.add_argument("--sweep", action="store_true",
                        help=f"the FlashAttention papers' sweep: {W.SWEEP_TOKENS} tokens per batch "
                             f"(B = {W.SWEEP_TOKENS} // S), hidden size {W.SWEEP_HIDDEN} (H = "
                             f"{W.SWEEP_HIDDEN} // D), S in {list(W.SWEEP_SEQLENS)}, D in "
                             f"{list(W.SWEEP_HEAD_DIMS)}")
    shapes.add_argument("--batch", type=_positive_int, help=f"batch size (default {W.SEED['batch']}; "
                        f"decode: {list(W.DECODE_BATCHES)})")
    shapes.add_argument("--heads", type=_positive_int, help=f"query heads (default {W.SEED['heads']}; "
                        f"decode: {W.DECODE_SHAPE['heads']})")
    shapes.add_argument("--heads-kv", type=_positive_int,
                        help="K/V heads for GQA/MQA, must divide --heads (default: = heads; decode: "
                             f"{W.DECODE_SHAPE['heads_kv']})")
    shapes.add_argument("--seqlen", type=_positive_int, nargs="+", metavar="S",
                        help=f"one or more sequence lengths (default {W.SEED['seqlen']}); for decode, "
                             f"context lengths (default {list(W.DECODE_CONTEXTS)})")
    shapes.add_argument("--headdim", type=_positive_int, nargs="+", metavar="D",
                        help=f"one or more head dims (default {W.SEED['head_dim']}; decode: "
                             f"{W.DECODE_SHAPE['head_dim']})")
    shapes.add_argument("--dtype", choices=list(W.DTYPES), default="fp16", help="(default: fp16)")
    shapes.add_argument("--window", type=_window, metavar="LEFT,RIGHT",
                        help="local (sliding-window) attention: keys within LEFT before and RIGHT after each "
                             "query's diagonal, -1 for no bound (fwd/bwd/fwdbwd: TFLOP/s count the visible "
                             "scores; decode: GB/s count the LEFT + 1 keys read). Providers without windows are "
                             "listed as unavailable")
    shapes.add_argument("--varlen", type=_varlen, nargs="+", metavar="SPEC",
                        help="packed sequences of different lengths, one workload per SPEC (fwd/bwd/fwdbwd; "
                             "instead of --seqlen and --batch): TOTAL:MIN-MAX[:SEED] draws lengths uniformly "
                             "from MIN..MAX (seeded, SEED default 0) until TOTAL tokens, the last one trimmed; "
                             "L1,L2,... gives the lengths. A k suffix multiplies by 1024: 32k:512-4k. Each "
                             "sequence attends to itself (Sq = Sk); TFLOP/s count its visible scores")
    shapes.add_argument("--causal", choices=["both", "yes", "no"], default="both",
                        help="causal masking (default: both); ignored for decode")
    variants = parser.add_argument_group("score variants (fwd/bwd/fwdbwd/decode; checked against the reference)")
    variants.add_argument("--softcap", type=_softcap, default=0.0, metavar="X",
                          help="logit soft-capping: scores become X * tanh(score / X), X > 0")
    variants.add_argument("--sinks", action="store_true",
                          help="attention sinks: one float32 logit per query head (random, seeded; values "
                               "exact in bfloat16), not trained (the backward gives dq, dk, dv)")
    variants.add_argument("--alibi", action="store_true",
                          help="ALiBi: the standard slopes per query head (2^(-8(h+1)/H) for H a power of 2)")
    parser.add_argument("--version", action="version", version=_version())
    run = parser.add_argument_group("run")
    run.add_argument("--providers", type=lambda s: [p.strip() for p in s.split(",") if p.strip()],
                     help="comma-separated list (default: all, see below)")
    run.add_argument("--warmup", type=float, default=25.0, metavar="MS",
                     help="do_bench warmup time in ms (default: 25)")
    run.add_argument("--rep", type=float, default=100.0, metavar="MS",
                     help="do_bench measuring time in ms (default: 100)")
    run.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR",
                     help="where results.json, results.md and the PNG figures go (default: ./bench-out)")
    run.add_argument("--no-plots", action="store_true", help="do not draw the PNG figures")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and resolve: adds ``causal_flags``, ``workloads`` (list of Workload) and
    ``provider_names`` (in table order)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sweep and args.mode in ("decode", "host"):
        parser.error(f"--sweep is for fwd/bwd/fwdbwd; {args.mode} runs its own shapes")
    if args.window is not None and args.mode == "host":
        parser.error("--window is for fwd/bwd/fwdbwd/decode; got --mode host")
    if args.varlen is not None:
        if args.mode in ("decode", "host"):
            parser.error(f"--varlen is for fwd/bwd/fwdbwd; got --mode {args.mode}")
        clash = [flag for flag, given in (("--sweep", args.sweep), ("--seqlen", args.seqlen is not None),
                                          ("--batch", args.batch is not None)) if given]
        if clash:
            parser.error(f"--varlen sets the sequence lengths and their number: drop {', '.join(clash)}")
    variants = {"softcap": args.softcap, "sinks": args.sinks, "alibi": args.alibi}
    if args.mode == "host" and any(variants.values()):
        parser.error("--softcap, --sinks and --alibi are for fwd/bwd/fwdbwd/decode; got --mode host")
    args.causal_flags = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    try:
        if args.mode == "host":
            args.workloads = W.host_workloads(args.dtype, args.causal_flags, batch=args.batch, heads=args.heads,
                                              heads_kv=args.heads_kv, seqlens=args.seqlen, head_dims=args.headdim)
        elif args.mode == "decode":
            args.workloads = W.decode_workloads(args.dtype, batch=args.batch, heads=args.heads,
                                                heads_kv=args.heads_kv, contexts=args.seqlen,
                                                head_dims=args.headdim, window=args.window, variants=variants)
        else:
            args.workloads = W.dense_workloads(args.mode, args.dtype, args.causal_flags, sweep=args.sweep,
                                               batch=args.batch, heads=args.heads, heads_kv=args.heads_kv,
                                               seqlens=args.seqlen, head_dims=args.headdim, window=args.window,
                                               varlen=args.varlen, variants=variants)
    except ValueError as exc:
        parser.error(str(exc))
    known = provider_names(args.mode)
    chosen = args.providers or provider_names(args.mode, defaults_only=True)
    forced = [p for p in chosen if args.mode != "decode" and forced_provider(p) is not None]
    unknown = [p for p in chosen if p not in known and p not in forced]
    if unknown:
        parser.error(f"unknown provider(s) for --mode {args.mode}: {', '.join(unknown)}; "
                     f"choose from {', '.join(known)}")
    args.provider_names = [p for p in known if p in chosen] + forced
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``triflash bench`` and ``python -m triflash.bench``; returns the exit status.

    The console script is ``triflash``: a leading ``bench`` word is accepted and dropped.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        argv = argv[1:]
    args = parse_args(argv)
    if not torch.cuda.is_available():
        return _without_gpu(args, argv)
    return run_benchmark(args, argv, device="cuda", timer=DoBench(args.warmup, args.rep),
                         env=report.environment())


def _host_benchmark(args, providers, device, env: dict, command: str) -> int:
    from .host import HOST_CONVENTION, host_table, run_host

    results = run_host(args.workloads, providers, device, progress=stderr_progress)
    text = "\n\n".join([report.header(env, command, args.warmup, args.rep, decode=False,
                                       timing=HOST_CONVENTION), f"## host time per call, {args.dtype}",
                         host_table(results)]) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)
    report.write_json(args.out / "results.json", results, env, command, args.warmup, args.rep)
    print(f"Wrote {args.out / 'results.md'}, {args.out / 'results.json'}", file=sys.stderr)
    return 1 if any(r.status == "wrong" and r.provider.startswith("triflash") for r in results) else 0


def _without_gpu(args, argv: list[str]) -> int:
    if not interpreter.interpreter_ready():
        return interpreter.rerun_with_interpreter(argv)
    return 0 if interpreter.report_without_gpu(args.causal_flags) else 1


def run_benchmark(args, argv: list[str], device, timer, env: dict) -> int:
    """Run every selected provider on every workload, then print and write the results.

    ``timer(fn) -> (median, p20, p80)`` in ms (``runner.DoBench`` on the GPU).
    """
    catalog = decode_providers() if args.mode == "decode" else dense_providers()
    providers = [p for p in catalog if p.name in args.provider_names]
    providers += [forced_provider(p) for p in args.provider_names if forced_provider(p) is not None]
    print(f"triflash bench on {env['gpu']}: {len(args.workloads)} workload(s) x {len(providers)} "
          f"provider(s)", file=sys.stderr)
    command = shlex.join(["triflash", "bench", *argv])
    if args.mode == "host":
        return _host_benchmark(args, providers, device, env, command)
    results = run_all(args.workloads, providers, timer, device)

    head = report.header(env, command, args.warmup, args.rep, decode=args.mode == "decode")
    text = report.markdown(results, head)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)
    report.write_json(args.out / "results.json", results, env, command, args.warmup, args.rep)
    written = [args.out / "results.md", args.out / "results.json"]
    if args.no_plots:
        print("Plots: skipped (--no-plots).", file=sys.stderr)
    else:
        figures = plot_results(results, env, args.out)
        if figures is None:
            print("Plots: skipped, matplotlib is not installed (pip install 'triflash[bench]').",
                  file=sys.stderr)
        else:
            written += figures
    print("Wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    triflash_wrong = any(r.status == "wrong" and r.provider.startswith("triflash") for r in results)
    return 1 if triflash_wrong else 0


VARLEN_SYNTAX = "TOTAL:MIN-MAX[:SEED] or L1,L2,... (positive integers, k = x1024)"


def _count(text: str) -> int:
    """A positive integer, with an optional k suffix (x1024)."""
    text = text.strip().lower()
    value = int(text[:-1]) * 1024 if text.endswith("k") else int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _varlen(text: str) -> tuple[int, ...]:
    """--varlen SPEC -> the sequence lengths (see the option's help)."""
    try:
        if ":" not in text:
            return tuple(_count(x) for x in text.split(","))
        total, bounds, *rest = text.split(":")
        low, high = bounds.split("-")
        total, low, high = _count(total), _count(low), _count(high)
        seed = int(rest.pop()) if len(rest) == 1 else 0
        if rest or seed < 0:
            raise ValueError(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {VARLEN_SYNTAX}, got {text!r}") from None
    if low > high:
        raise argparse.ArgumentTypeError(f"MIN ({low}) is larger than MAX ({high}) in {text!r}")
    return W.varlen_lengths(total, low, high, seed)


def _softcap(text: str) -> float:
    """--softcap X: what flash_attn_func accepts (validation.check_softcap), and not 0 (no capping:
    leave the flag out)."""
    from ..validation import check_softcap

    try:
        value = check_softcap(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r} ({exc})") from None
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _window(text: str) -> tuple[int, int]:
    """--window LEFT,RIGHT: two ints >= -1."""
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (two ints, -1 for no bound), got {text!r}") from None
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"window bounds must be >= -1, got {text!r}")
    return left, right

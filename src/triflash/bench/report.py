"""What the benchmark prints and writes: the header, Markdown tables and results.json."""

from __future__ import annotations

import json
import math
import platform
import subprocess
from pathlib import Path

import torch

from .runner import Result
from .workloads import BYTES_CONVENTION, FLOP_CONVENTION

CHECK_CONVENTION = (
    "Each provider is run once and compared with triflash.reference.attention_ref in float32 before it "
    "is timed (outputs; and dq, dk, dv for bwd/fwdbwd): max|err| <= 2 x max|err of PyTorch's attention "
    "in the same dtype| + eps(dtype) x max|ref|. WRONG rows are not timed.")
MEMORY_CONVENTION = ("Peak MiB: torch.cuda.max_memory_allocated during one call, minus what was "
                     "allocated before it (inputs excluded, outputs and workspace included).")


def timing_convention(warmup_ms: float, rep_ms: float) -> str:
    return (f"triton.testing.do_bench(warmup={warmup_ms:g} ms, rep={rep_ms:g} ms), quantiles 0.5/0.2/0.8: "
            "median with p20-p80. Inputs are made in each provider's own layout before timing; bwd times "
            "the backward only (the forward runs once outside).")


# --------------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------------

def driver_version() -> str:
    """The NVIDIA driver version from nvidia-smi; else the CUDA version the driver supports."""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if smi.returncode == 0 and smi.stdout.strip():
            return smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    if get is not None:
        v = get()
        return f"unknown (nvidia-smi not found; driver supports CUDA {v // 1000}.{v % 1000 // 10})"
    return "unknown (nvidia-smi not found)"


def environment() -> dict:
    """GPU and software versions for the header and results.json (call on a CUDA machine)."""
    import triton

    import triflash

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "driver": driver_version(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "triflash": triflash.__version__,
        "python": platform.python_version(),
    }


def header(env: dict, command: str, warmup_ms: float, rep_ms: float, decode: bool,
           timing: str | None = None) -> str:
    """The Markdown lines above the tables: what ran where, and how the numbers are defined
    (``timing`` replaces the do_bench convention, for --mode host)."""
    return "\n".join([
        "# triflash bench",
        "",
        f"`{command}`",
        "",
        f"- GPU: {env['gpu']} (compute capability {env['compute_capability']}, "
        f"{env['multiprocessors']} SMs, {env['gpu_memory_gib']} GiB), driver {env['driver']}",
        f"- CUDA {env['cuda']}, torch {env['torch']}, triton {env['triton']}, "
        f"triflash {env['triflash']}, Python {env['python']}",
        f"- Timing: {timing or timing_convention(warmup_ms, rep_ms)}",
        f"- {BYTES_CONVENTION if decode else FLOP_CONVENTION}",
        f"- Check: {CHECK_CONVENTION}",
        f"- {MEMORY_CONVENTION}",
    ])


# --------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------

def _num(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def _heads(r: Result) -> str:
    wl = r.workload
    return str(wl.heads) if wl.heads == wl.heads_kv else f"{wl.heads}/{wl.heads_kv}"


def _status(r: Result) -> str:
    label = {"ok": "ok", "wrong": "WRONG", "oom": "OOM", "error": "error", "unavailable": "unavailable"}
    text = label[r.status] if r.status == "ok" else f"{label[r.status]}: {r.detail}"
    return text.replace("|", "\\|")


def _err(r: Result) -> str:
    if r.max_err is None or r.tol is None:
        return ""
    return f"{r.max_err:.1e} ({r.tol:.1e})"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _seqlen(r: Result) -> str:
    """The S column: the sequence length, or for packed sequences the shortest-longest and the total."""
    wl = r.workload
    if wl.seqlens is None:
        return str(wl.seqlen_q)
    return f"{min(wl.seqlens)}-{max(wl.seqlens)} ({wl.tokens} tok)"


def dense_table(results: list[Result]) -> str:
    head = ["S", "B", "H", "provider", "median ms", "p20-p80 ms", "TFLOP/s", "vs naive",
            "vs best SDPA", "peak MiB", "max err (tol)", "status"]
    rows = [[_seqlen(r), str(r.workload.batch), _heads(r), r.provider, _num(r.ms, ".3f"),
             f"{r.ms_p20:.3f}-{r.ms_p80:.3f}" if r.ms else "", _num(r.tflops, ".1f"),
             _num(r.speedup_naive, ".2f") + ("x" if r.speedup_naive else ""),
             _num(r.speedup_sdpa, ".2f") + ("x" if r.speedup_sdpa else ""), _num(r.peak_mib, ".1f"),
             _err(r), _status(r)] for r in results]
    return _table(head, rows)


def decode_table(results: list[Result]) -> str:
    head = ["B", "context", "H", "provider", "graph us/call", "p20-p80 us", "eager us/call", "p20-p80 us",
            "GB/s (graph)", "vs best SDPA (graph)", "peak MiB", "max err (tol)", "status"]
    rows = [[str(r.workload.batch), str(r.workload.seqlen_k), _heads(r), r.provider,
             _num(r.ms * 1e3 if r.ms else None, ".1f"),
             f"{r.ms_p20 * 1e3:.1f}-{r.ms_p80 * 1e3:.1f}" if r.ms else "",
             _num(r.ms_eager * 1e3 if r.ms_eager else None, ".1f"),
             f"{r.ms_eager_p20 * 1e3:.1f}-{r.ms_eager_p80 * 1e3:.1f}" if r.ms_eager else "",
             _num(r.gbps, ".0f"),
             _num(r.speedup_sdpa, ".2f") + ("x" if r.speedup_sdpa else ""), _num(r.peak_mib, ".1f"),
             _err(r), _status(r)] for r in results]
    return _table(head, rows)


def group_key(r: Result) -> tuple:
    """Results that share a table (and a figure): same mode, dtype, head_dim and causal flag, and the
    same packed lengths and score variants (``extra``: "" for neither)."""
    wl = r.workload
    extra = ", ".join(x for x in (wl.varlen_label(), wl.variants_label()) if x)
    return (wl.mode, wl.dtype, wl.head_dim, wl.causal, extra)


def group_title(key: tuple) -> str:
    mode, dtype, head_dim, causal, extra = key
    extra = f", {extra}" if extra else ""
    if mode == "decode":
        return f"decode, {dtype}, D={head_dim}{extra}"
    return f"{mode}, {dtype}, D={head_dim}, {'causal' if causal else 'non-causal'}{extra}"


def grouped(results: list[Result]) -> dict[tuple, list[Result]]:
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        groups.setdefault(group_key(r), []).append(r)
    return groups


def markdown(results: list[Result], head: str) -> str:
    """The whole report: header, one table per group, then the providers that did not run and why."""
    parts = [head]
    for key, group in grouped(results).items():
        ran = [r for r in group if r.status != "unavailable"]
        if ran:
            table = decode_table(ran) if key[0] == "decode" else dense_table(ran)
            parts += [f"## {group_title(key)}", table]
    unavailable = not_run(results)
    if unavailable:
        parts += ["## Not run", "\n".join(unavailable)]
    return "\n\n".join(parts) + "\n"


def not_run(results: list[Result]) -> list[str]:
    """One line per (provider, reason) of the unavailable results, with how many workloads it hit."""
    total = len({r.workload for r in results})
    counts: dict[tuple[str, str], int] = {}
    for r in results:
        if r.status == "unavailable":
            counts[(r.provider, r.detail)] = counts.get((r.provider, r.detail), 0) + 1
    lines = []
    for (provider, reason), n in counts.items():
        scope = f"all {total} workloads" if n == total else f"{n} of {total} workloads"
        lines.append(f"- {provider}: unavailable: {reason} ({scope})")
    return lines


# --------------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------------

def _finite_or_none(value):
    """NaN and infinities become null: results.json stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, results: list[Result], env: dict, command: str, warmup_ms: float,
               rep_ms: float) -> None:
    data = {
        "command": command,
        "environment": env,
        "conventions": {"flops": FLOP_CONVENTION, "bytes": BYTES_CONVENTION, "check": CHECK_CONVENTION,
                        "memory": MEMORY_CONVENTION, "timing": timing_convention(warmup_ms, rep_ms)},
        "results": [{k: _finite_or_none(v) for k, v in r.to_dict().items()} for r in results],
    }
    path.write_text(json.dumps(data, indent=1) + "\n")

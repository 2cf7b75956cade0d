"""prepare -> check -> time -> measure memory, for every (workload, provider) pair.

For one workload the inputs and references are made once (``checking``); then, for each provider:

1. ``setup`` and ``prepare``: inputs in the provider's own layout, copies and plans included, all
   outside the timed region;
2. one call, compared with the reference (outputs, and gradients in bwd / fwdbwd). A provider that
   fails is "wrong" and is not timed;
3. ``timer(fn)`` -> (median, p20, p80) in ms, by default ``triton.testing.do_bench``;
4. one more call between ``reset_peak_memory_stats`` and ``max_memory_allocated``: the peak memory
   the call adds on top of what was allocated before it (inputs excluded, outputs included).

What is timed, per mode: fwd / decode, the forward call. bwd, only the backward: the forward runs
once outside and ``torch.autograd.grad(out, inputs, dout, retain_graph=True)`` is timed (grads are
returned, not accumulated into ``.grad``, so no extra add kernel). fwdbwd: forward and that backward.

Outcomes other than "ok" never stop the run: "unavailable" (package missing, feature or shape not
supported, no backward), "wrong", "oom" (torch.cuda.OutOfMemoryError; memory is freed afterwards) and
"error" (anything else, with its message).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import torch

from .checking import check, make_decode_case, make_dense_case
from .providers import Unavailable
from .workloads import Workload

# How SDPA says that the forced backend cannot run a case (CUDA, CPU).
SDPA_NO_KERNEL = ("No available kernel", "No viable backend")
# SDPA on nested (jagged) tensors logs, rather than warns, why a backend declined.
SDPA_LOGGERS = ("torch.nested._internal.sdpa",)


@dataclass
class Result:
    """One (workload, provider) outcome. Times in ms; memory in MiB; None where not measured."""

    workload: Workload
    provider: str
    status: str
    detail: str = ""
    max_err: float | None = None
    tol: float | None = None
    ms: float | None = None
    ms_p20: float | None = None
    ms_p80: float | None = None
    peak_mib: float | None = None
    ms_eager: float | None = None          # decode: eager calls (``ms`` is CUDA-graph replays)
    ms_eager_p20: float | None = None
    ms_eager_p80: float | None = None
    speedup_naive: float | None = None
    speedup_sdpa: float | None = None

    @property
    def tflops(self) -> float | None:
        flops = self.workload.flops
        return flops / (self.ms * 1e-3) / 1e12 if self.ms and flops else None

    @property
    def gbps(self) -> float | None:
        """K/V bytes read per second, in GB/s (decode only)."""
        if not self.ms or self.workload.mode != "decode":
            return None
        return self.workload.kv_bytes / (self.ms * 1e-3) / 1e9

    def to_dict(self) -> dict:
        """Flat dict for results.json: workload fields, outcome, raw and derived numbers."""
        out = asdict(self.workload)
        out.update({k: v for k, v in asdict(self).items() if k != "workload"})
        out.update(tflops=self.tflops, gbps=self.gbps, flops=self.workload.flops,
                   kv_bytes=self.workload.kv_bytes if self.workload.mode == "decode" else None)
        return out


class DoBench:
    """The default timer: ``triton.testing.do_bench`` with quantiles [0.5, 0.2, 0.8] -> ms."""

    def __init__(self, warmup_ms: float, rep_ms: float):
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

    def __call__(self, fn) -> tuple[float, float, float]:
        import triton.testing

        median, p20, p80 = triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms,
                                                   quantiles=[0.5, 0.2, 0.8])
        return median, p20, p80


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_all(workloads: list[Workload], providers: list, timer, device,
            progress=stderr_progress) -> list[Result]:
    """Every provider on every workload, in order; returns one Result per pair (speedups filled)."""
    missing = {p.name: load_error(p) for p in providers}
    results = []
    clock = Progress(len(workloads))
    for index, wl in enumerate(workloads, 1):
        runnable = [p for p in providers if missing[p.name] is None]
        case, case_failure = None, None
        if runnable:
            try:
                case = make_decode_case(wl, device) if wl.mode == "decode" else make_dense_case(wl, device)
            except torch.cuda.OutOfMemoryError as exc:
                case_failure = ("oom", f"making the inputs and reference: {_first_line(exc)}")
        for provider in providers:
            if missing[provider.name] is not None:
                results.append(Result(wl, provider.name, "unavailable", missing[provider.name]))
                continue
            progress(f"[{index}/{len(workloads)} {clock.status(index - 1)}] {wl.label()} provider={provider.name}")
            if case_failure:
                results.append(Result(wl, provider.name, *case_failure))
            else:
                results.append(run_one(provider, case, timer, device))
            if results[-1].status == "oom":
                free_memory(device)
        del case
        free_memory(device)
    add_speedups(results)
    return results


class Progress:
    """Elapsed time, and an estimate of the time left from the workloads done so far."""

    def __init__(self, total: int):
        self.total, self.start = total, time.monotonic()

    def status(self, done: int) -> str:
        elapsed = time.monotonic() - self.start
        text = f"{_clock(elapsed)} elapsed"
        if done:
            text += f", ~{_clock(elapsed / done * (self.total - done))} left"
        return text


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}:{seconds:02d}"


def load_error(provider) -> str | None:
    """None when the provider's library imports; else why not (shown as "unavailable"). A package
    that is installed but fails to import (a build for another torch, say) counts as unavailable."""
    try:
        provider.load()
    except Exception as exc:  # noqa: BLE001 - ImportError, Unavailable, or a broken install
        reason = _first_line(exc)
        return reason if isinstance(exc, (ImportError, Unavailable)) else f"{type(exc).__name__}: {reason}"
    return None


def run_one(provider, case, timer, device) -> Result:
    """Check one provider on one workload, then time it if it is correct."""
    wl = case.workload
    caught, logged = [], []
    try:
        with provider.context():
            with warnings.catch_warnings(record=True) as caught, _logged(SDPA_LOGGERS, logged):
                warnings.simplefilter("always")
                provider.bind(wl)
                provider.setup(wl, device)
                prepared = provider.prepare(case, requires_grad=wl.mode in ("bwd", "fwdbwd"))
                verdict = check(outputs(provider, prepared, wl), case.expected)
            if not verdict.ok:
                return Result(wl, provider.name, "wrong", verdict.detail, verdict.max_err, verdict.tol)
            fn = timed_call(provider, prepared, wl.mode)
            timed_fn, how = (as_cuda_graph(fn, device) if wl.mode == "decode" else (fn, ""))
            ms, p20, p80 = timer(timed_fn)
            eager = timer(fn) if wl.mode == "decode" else (None, None, None)
            peak = peak_memory_mib(fn, device)
    except Exception as exc:  # noqa: BLE001 - every failure is reported in the table, the run goes on
        status, detail = classify(exc, [str(w.message) for w in caught] + logged)
        return Result(wl, provider.name, status, detail)
    detail = "; ".join(x for x in (verdict.detail, how) if x)
    return Result(wl, provider.name, "ok", detail, verdict.max_err, verdict.tol, ms, p20, p80, peak, *eager)


@contextlib.contextmanager
def _logged(names, into: list):
    """Collect (and keep off stderr) what the loggers ``names`` say at WARNING and above, less the
    "... kernel not used because:" headers."""

    class Collect(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if not message.rstrip().endswith("because:"):
                into.append(message)

    handler = Collect(logging.WARNING)
    loggers = [logging.getLogger(n) for n in names]
    saved = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        yield into
    finally:
        for lg, propagate in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.propagate = propagate


def outputs(provider, prepared, wl: Workload) -> list[torch.Tensor]:
    """One call: [out] or [out, dq, dk, dv], in the canonical layout, for the check."""
    out = provider.run(*prepared.args)
    if not prepared.leaves:
        return [provider.canonical(out, wl)]
    if out.grad_fn is None:
        raise Unavailable(f"{provider.name} has no backward (its output has no grad_fn)")
    grads = torch.autograd.grad(out, prepared.leaves, prepared.dout)
    return [provider.canonical(t, wl) for t in (out, *grads)]


def timed_call(provider, prepared, mode: str):
    """The function the timer calls: only the provider's own work (see the module docstring)."""
    run, args = provider.run, prepared.args
    if mode in ("fwd", "decode"):
        return lambda: run(*args)
    leaves, dout = prepared.leaves, prepared.dout
    if mode == "bwd":
        out = run(*args)
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return lambda: torch.autograd.grad(run(*args), leaves, dout)


def as_cuda_graph(fn, device):
    """Decode steps are a few microseconds of GPU work behind several launches. Serving engines
    capture decode steps in CUDA graphs, so every decode provider is timed as graph replays (the
    kernels' time) as well as eagerly (what a plain generate loop sees, host time included).
    Returns (callable, note); falls back to eager calls, saying so, when capture fails."""
    if torch.device(device).type != "cuda":
        return fn, ""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()                                         # warm up (compiles, allocator) off-graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, "timed as CUDA-graph replays"
    except Exception as exc:  # noqa: BLE001 - a provider that cannot be captured is timed eagerly
        torch.cuda.synchronize()
        return fn, f"timed eagerly (CUDA-graph capture failed: {_first_line(exc)[:80]})"


def peak_memory_mib(fn, device) -> float | None:
    """Peak memory one call of ``fn`` adds on top of what is allocated before it (CUDA only)."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak / 2**20


def classify(exc: Exception, warning_messages=()) -> tuple[str, str]:
    """(status, detail) for an exception raised while preparing, checking or timing a provider."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom", _first_line(exc)
    if isinstance(exc, (Unavailable, NotImplementedError)):
        return "unavailable", _first_line(exc) or type(exc).__name__
    if isinstance(exc, RuntimeError) and any(m in str(exc) for m in SDPA_NO_KERNEL):
        # SDPA explains in warnings why the forced backend declined.
        reasons = " ".join(dict.fromkeys(m.strip().splitlines()[0] for m in warning_messages if m.strip()))
        return "unavailable", "SDPA has no kernel for this case" + (f": {reasons[:240]}" if reasons else "")
    return "error", f"{type(exc).__name__}: {_first_line(exc)}"


def free_memory(device) -> None:
    """Give cached blocks back after an OOM (and between workloads), so the next one starts clean."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def add_speedups(results: list[Result]) -> None:
    """speedup_naive = naive's median / this median; speedup_sdpa = the fastest correct SDPA backend's
    median / this median; both on the same workload, None when the baseline did not run."""
    by_workload: dict[Workload, list[Result]] = {}
    for r in results:
        by_workload.setdefault(r.workload, []).append(r)
    for group in by_workload.values():
        timed = [r for r in group if r.status == "ok" and r.ms]
        naive = next((r.ms for r in timed if r.provider == "naive"), None)
        sdpa = min((r.ms for r in timed if r.provider.startswith("sdpa-")), default=None)
        for r in timed:
            r.speedup_naive = naive / r.ms if naive else None
            r.speedup_sdpa = sdpa / r.ms if sdpa else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""

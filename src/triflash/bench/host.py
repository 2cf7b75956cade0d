"""``triflash bench --mode host``: what one call costs the host, per provider, called eagerly.

Most attention calls in a model are short: a layer's forward at a few hundred tokens, a decode step.
There the GPU finishes before the host has issued the next call, and the host time of a call (Python,
argument checks, allocation, kernel launches, the autograd engine) is what a user waits for. This
mode measures it apart from the kernels:

* the GPU is first given a ``torch.cuda._sleep`` longer than the timed loop, so no call ever waits
  for the GPU (the queue never fills, nothing synchronises);
* ``calls`` calls are timed on the host clock; that is repeated ``repeats`` times, and the median,
  p20 and p80 of the per-call times are reported (the host of a shared machine is noisy);
* three kinds of call per workload: the forward under ``torch.no_grad()``, the forward recording an
  autograd graph (inputs that require grad), and forward + backward (``torch.autograd.grad``).

Every provider is checked against the reference first (forward and gradients), as in the other modes.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from .checking import check, make_dense_case
from .runner import Progress, classify, free_memory, outputs, timed_call
from .workloads import Workload

KINDS = ("fwd no_grad", "fwd grad", "fwd+bwd")


@dataclasses.dataclass
class HostResult:
    """One (workload, provider): host microseconds per call (median, p20, p80) of each kind."""

    workload: Workload
    provider: str
    status: str
    detail: str = ""
    us: dict = dataclasses.field(default_factory=dict)        # kind -> (median, p20, p80)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self.workload)
        out.update(provider=self.provider, status=self.status, detail=self.detail,
                   host_us={k: list(v) for k, v in self.us.items()})
        return out


def host_us(fn, calls: int, repeats: int) -> tuple[float, float, float]:
    """(median, p20, p80) host microseconds per call of ``fn`` over ``repeats`` loops of ``calls``."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    guess_us = (time.perf_counter() - start) * 1e6          # an upper bound: host and GPU time
    clock_khz = torch.cuda.get_device_properties(torch.cuda.current_device()).clock_rate or 2_000_000
    per_call = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(min(2.0 * calls * guess_us, 2e6) * clock_khz / 1e3))
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    quantiles = statistics.quantiles(per_call, n=10) if len(per_call) > 1 else per_call * 9
    return statistics.median(per_call), quantiles[1], quantiles[7]


def run_host(workloads: list[Workload], providers: list, device, calls: int = 100, repeats: int = 9,
             progress=None) -> list[HostResult]:
    """Check, then time the three kinds of call, for every provider on every (fwdbwd) workload."""
    results = []
    clock = Progress(len(workloads))
    for index, wl in enumerate(workloads, 1):
        case = make_dense_case(wl, device)
        for provider in providers:
            if progress:
                progress(f"[{index}/{len(workloads)} {clock.status(index - 1)}] {wl.label()} B={wl.batch} "
                         f"H={wl.heads} provider={provider.name}")
            results.append(_one(provider, case, device, calls, repeats))
        del case
        free_memory(device)
    return results


def _one(provider, case, device, calls, repeats) -> HostResult:
    wl = case.workload
    try:
        provider.load()
        with provider.context():
            provider.bind(wl)
            provider.setup(wl, device)
            prepared = provider.prepare(case, requires_grad=True)
            verdict = check(outputs(provider, prepared, wl), case.expected)
            if not verdict.ok:
                return HostResult(wl, provider.name, "wrong", verdict.detail)
            plain = provider.prepare(case, requires_grad=False)
            run = provider.run

            def no_grad():
                with torch.no_grad():
                    return run(*plain.args)

            us = {"fwd no_grad": host_us(no_grad, calls, repeats),
                  "fwd grad": host_us(lambda: run(*prepared.args), calls, repeats),
                  "fwd+bwd": host_us(timed_call(provider, prepared, "fwdbwd"), calls, repeats)}
    except Exception as exc:  # noqa: BLE001 - reported in the table, the run goes on
        status, detail = classify(exc)
        return HostResult(wl, provider.name, status, detail)
    return HostResult(wl, provider.name, "ok", us=us)


def host_table(results: list[HostResult]) -> str:
    """Markdown: one row per (workload, provider), host us per call (median, p20-p80) of each kind."""
    head = ["B,S,H,D", "causal", "provider", *(f"{k} us (p20-p80)" for k in KINDS), "fwd calls/s",
            "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in results:
        wl = r.workload
        cells = [f"{wl.batch},{wl.seqlen_q},{wl.heads},{wl.head_dim}", "yes" if wl.causal else "no",
                 r.provider]
        for k in KINDS:
            m = r.us.get(k)
            cells.append(f"{m[0]:.1f} ({m[1]:.1f}-{m[2]:.1f})" if m else "")
        fwd = r.us.get("fwd no_grad")
        cells.append(f"{1e6 / fwd[0]:,.0f}" if fwd else "")
        cells.append(r.status if r.status == "ok" else f"{r.status}: {r.detail}".replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


HOST_CONVENTION = (
    "Host us per call: the GPU is first given a long torch.cuda._sleep so that no call waits for it, "
    "then N eager calls are timed on the host clock; median and p20-p80 over the repeats. fwd no_grad: "
    "the forward under torch.no_grad(); fwd grad: the forward recording autograd (inputs require grad); "
    "fwd+bwd: the forward and torch.autograd.grad. These are host times, not GPU times: a call whose "
    "kernels run longer than its host time is GPU-bound, and the other modes time that.")

"""Host time against GPU time per training call, for triflash's two autograd roads and cuDNN.

Why: at short sequences a training step through triflash took several times cuDNN's time while its
kernels are short (run 41): the host, not the GPU, set the pace. This script separates the two.

For every shape, mode (fwd without a graph, bwd alone, fwd+bwd) and provider it reports:

* ``bench``: what ``triflash bench`` reports (``run_one``: checked against the reference, then
  do_bench's median, which is whichever of host and GPU is slower, plus the L2 flush);
* ``host``: host time per call. The GPU is first given a long ``torch.cuda._sleep``, so no call
  ever waits for it, and ``n`` calls are timed on the host clock (the least of 9 such means);
* ``gpu``: GPU time per call with the queue kept full: CUDA events around the same ``n`` calls,
  queued behind the sleep, so the GPU runs them back to back (no flush between them).

Providers: ``triflash`` (eager autograd on plain tensors: ``_EagerAttention``, the current road),
``triflash (op)`` (every call through the ``triflash::attn_fwd`` custom op, as before run 42, by
patching ``_needs_op``), and SDPA's cuDNN backend. The profile file holds cProfile's top functions
(by own time) for fwd+bwd of the first shape on both triflash roads.

    PYTHONPATH=src python3 scripts/gpu_host_time.py [--out DIR] [--shapes B,H,S,D,causal|full ...]
"""

import argparse
import contextlib
import cProfile
import dataclasses
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import triton

import triflash.autograd
from triflash.bench.checking import make_dense_case
from triflash.bench.providers import Sdpa, Triflash
from triflash.bench.runner import DoBench, free_memory, run_one, timed_call
from triflash.bench.workloads import dense_workloads

SHAPES = ["2,4,4096,128,causal", "2,8,1024,64,causal", "8,16,1024,128,full", "4,16,4096,64,full"]
MODES = ("fwd", "bwd", "fwdbwd")


class TriflashOp(Triflash):
    """flash_attn_func with every call through the custom op (the road before run 42)."""

    name = "triflash (op)"

    @contextlib.contextmanager
    def context(self):
        saved = triflash.autograd._needs_op
        triflash.autograd._needs_op = lambda *_: True
        try:
            yield
        finally:
            triflash.autograd._needs_op = saved


def workload(text: str, mode: str):
    parts = text.split(",")
    b, h, s, d = map(int, parts[:4])
    return dense_workloads(mode, "fp16", [parts[4] == "causal"], batch=b, heads=h, seqlens=(s,),
                           head_dims=(d,))[0]


def host_and_gpu_us(fn, n: int, repeats: int = 9) -> tuple[float, float]:
    """(host us per call, GPU us per call): ``n`` calls queued behind a GPU sleep; the least of
    ``repeats`` host means (the GPU machine's host is shared: interruptions only ever add time, and
    medians moved by 2x between runs of the same code in run 42) and the median GPU mean."""
    hosts, gpus = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(400_000_000)            # ~0.2 s at 1.98 GHz: longer than the host loop
        start.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = time.perf_counter() - t0
        end.record()
        torch.cuda.synchronize()
        hosts.append(host / n * 1e6)
        gpus.append(start.elapsed_time(end) / n * 1e3)
    return min(hosts), statistics.median(gpus)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}",
          flush=True)
    timer = DoBench(25, 100)
    providers = [Triflash(), TriflashOp(), Sdpa("cudnn")]
    for p in providers:
        p.load()
    rows, profiles = [], io.StringIO()
    for si, shape in enumerate(a.shapes):
        base = make_dense_case(workload(shape, "bwd"), device)
        fwd_case = dataclasses.replace(
            base, workload=workload(shape, "fwd"), dout=None,
            expected=[e for e in base.expected if e.name == "out"])
        for mode in MODES:
            case = fwd_case if mode == "fwd" else dataclasses.replace(base, workload=workload(shape, mode))
            for p in providers:
                res = run_one(p, case, timer, device)
                row = dict(shape=shape, mode=mode, provider=p.name, status=res.status,
                           bench_us=res.ms * 1e3 if res.ms else None, max_err=res.max_err, tol=res.tol)
                if res.status == "ok":
                    with p.context():
                        p.setup(case.workload, device)
                        prepared = p.prepare(case, requires_grad=mode != "fwd")
                        fn = timed_call(p, prepared, mode)
                        fn()
                        row["host_us"], row["gpu_us"] = host_and_gpu_us(fn, a.calls)
                        if si == 0 and mode == "fwdbwd" and p.name.startswith("triflash"):
                            prof = cProfile.Profile()
                            prof.enable()
                            for _ in range(100):
                                fn()
                            prof.disable()
                            torch.cuda.synchronize()
                            profiles.write(f"\n==== {shape} {mode} {p.name}: 100 calls ====\n")
                            pstats.Stats(prof, stream=profiles).sort_stats("tottime").print_stats(30)
                else:
                    row["detail"] = res.detail
                rows.append(row)
                print(json.dumps(row), flush=True)
        del base, fwd_case, case
        free_memory(device)
    with open(os.path.join(a.out, "host_time.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(a.out, "host_profile.txt"), "w") as f:
        f.write(profiles.getvalue())
    print("\n| shape | mode | provider | bench us | host us | GPU us (queued) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['shape']} | {r['mode']} | {r['provider']} | {r['status']} | | |")
            continue
        print(f"| {r['shape']} | {r['mode']} | {r['provider']} | {r['bench_us']:.0f} | "
              f"{r['host_us']:.0f} | {r['gpu_us']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The backward chooser checked where training uses it: ``flash_attn_func`` through autograd, the
backward alone and forward+backward, with the chooser as it is, the Triton backward kernels forced,
each Gluon backward form forced (``dkdv``: the dK/dV kernel, with the Gluon dQ kernel at head_dim 128;
and the fused kernel), SDPA's cuDNN backend beside them, in interleaved rounds.

Why: the Hopper backward (backward_hopper.py) was chosen from backward-only timings of the kernel
launcher. In training a forward kernel runs right before it; this checks that the pick holds there
too.

Everything goes through the benchmark's runner (``triflash.bench.runner.run_one``): each call is
checked against the reference under the benchmark's rule (2x PyTorch's own same-dtype error plus a
rounding floor; a wrong one is not timed), then timed with do_bench, exactly as ``triflash bench
--mode bwd / fwdbwd`` does. The table printed last gives the median over ``--rounds`` rounds.

    PYTHONPATH=src python3 scripts/gpu_train_step.py [--rounds 5] [--out $OUT/train_step.json]
        [--shapes B,H,S,D,causal|full[,fp16|bf16] ...]
"""

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys

import torch
import triton

from triflash.bench.checking import make_dense_case
from triflash.bench.providers import Sdpa, Triflash, Unavailable
from triflash.bench.runner import DoBench, free_memory, run_one
from triflash.bench.workloads import dense_workloads
from triflash.kernels import configs

SHAPES = ["4,16,4096,64,causal", "4,16,4096,64,full", "4,16,4096,128,causal", "4,16,4096,128,full",
          "1,16,16384,128,full", "16,16,1024,128,full"]


def parse_shape(text: str):
    """"B,H,S,D,causal|full[,fp16|bf16]" -> a bwd Workload."""
    parts = text.split(",")
    b, h, s, d = map(int, parts[:4])
    dtype = parts[5] if len(parts) > 5 else "fp16"
    return dense_workloads("bwd", dtype, [parts[4] == "causal"], batch=b, heads=h, seqlens=(s,),
                           head_dims=(d,))[0]


class PinnedTriflash(Triflash):
    """``flash_attn_func`` with the backward's Hopper pick replaced by ``pick`` (a variant name, or
    None for the Triton kernels) around the check and the timing."""

    def __init__(self, label: str, pick):
        self.name, self.pick = f"triflash ({label})", pick

    def setup(self, wl, device):
        # The launcher quietly takes the Triton kernels where a forced variant does not apply; a row
        # labelled with a Gluon form must not be them.
        from triflash.kernels import backward_hopper

        if self.pick in backward_hopper.EXPERIMENTS:
            raise Unavailable(f"{self.pick} is a timing experiment (wrong dQ on purpose)")
        if self.pick is not None and wl.head_dim not in backward_hopper.VARIANTS[self.pick]:
            raise Unavailable(f"{self.pick} has no head_dim {wl.head_dim} configuration")

    @contextlib.contextmanager
    def context(self):
        saved = configs.hopper_backward_variant
        configs.hopper_backward_variant = lambda **_: self.pick
        try:
            yield
        finally:
            configs.hopper_backward_variant = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in SHAPES])
    ap.add_argument("--out", default="train_step.json")
    a = ap.parse_args(argv)
    # No GPU: the checks still run (Triton's interpreter, TRITON_INTERPRET=1), the timings fail.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'} | torch {torch.__version__} | triton {triton.__version__}",
          flush=True)
    timer = DoBench(25, 100)
    providers = [Triflash(), PinnedTriflash("Triton kernels", None), PinnedTriflash("Gluon dkdv", "dkdv"),
                 PinnedTriflash("fused", "split"), Sdpa("cudnn")]
    for p in providers:
        p.load()
    rows = []
    for wl in a.shapes:
        case = make_dense_case(wl, device)
        cases = [case, dataclasses.replace(case, workload=dataclasses.replace(wl, mode="fwdbwd"))]
        picked = configs.hopper_backward_variant(head_dim=wl.head_dim, dtype=wl.torch_dtype,
                                                 device=device, causal=wl.causal,
                                                 seqlen_q=wl.seqlen_q, seqlen_k=wl.seqlen_k)
        label = f"{wl.batch},{wl.heads},{wl.seqlen_k},{wl.head_dim} {wl.dtype} " \
                f"{'causal' if wl.causal else 'full'}"
        print(f"{label}: the chooser picks {picked}", flush=True)
        results = {}
        for _ in range(a.rounds):
            for c in cases:
                for p in providers:
                    key = (c.workload.mode, p.name)
                    if key in results and results[key][-1].status != "ok":
                        continue                             # wrong or failed once: not again
                    results.setdefault(key, []).append(run_one(p, c, timer, device))
        for (mode, name), res in results.items():
            if res[-1].status != "ok":
                print(f"  {mode} {name}: {res[-1].status.upper()} {res[-1].detail}", flush=True)
                continue
            ms = statistics.median(r.ms for r in res)
            rows.append(dict(shape=label, mode=mode, provider=name, picked=picked, ms=ms,
                             tflops=res[0].workload.flops / (ms * 1e-3) / 1e12,
                             spread=[min(r.ms for r in res), max(r.ms for r in res)],
                             max_err=res[0].max_err, tol=res[0].tol))
        del case, cases
        free_memory(device)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n| shape | mode | provider | ms (median of {a.rounds}) | TFLOP/s | min-max ms | max err (tol) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['mode']} | {r['provider']} | {r['ms']:.3f} | {r['tflops']:.1f} | "
              f"{r['spread'][0]:.3f}-{r['spread'][1]:.3f} | {r['max_err']:.1e} ({r['tol']:.1e}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

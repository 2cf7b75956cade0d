"""ALiBi against the plain call, forward and backward, at 4,16,4096 causal (fp16 and bf16, head dims
64 and 128), median ms of triton.testing.do_bench; at head dim 64 also the Gluon dK/dV kernel forced.
Run it with PYTHONPATH on each tree to compare two of them on one machine:

    PYTHONPATH=src python3 scripts/alibi_time.py TAG      # env DS=64,128 DT=fp16,bf16 NOFORCE=1
"""

import os
import sys

import torch
from triton.testing import do_bench

import triflash
from triflash.kernels import dispatch


def main():
    tag = sys.argv[1] if len(sys.argv) > 1 else "tree"
    torch.manual_seed(0)
    batch, heads, seqlen = 4, 16, 4096
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)], device="cuda", dtype=torch.float32)
    dtypes = dict(fp16=torch.float16, bf16=torch.bfloat16)
    rows = []
    for d in [int(x) for x in os.environ.get("DS", "64,128").split(",")]:
        for dt in [dtypes[x] for x in os.environ.get("DT", "fp16,bf16").split(",")]:
            q, k, v = [torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dt, requires_grad=True)
                       for _ in range(3)]
            do = torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dt)
            for name, kw in (("plain", {}), ("alibi", dict(alibi_slopes=slopes))):
                forced = [None] + (["dkdv"] if name == "alibi" and d == 64 and not os.environ.get("NOFORCE") else [])
                for bwd in forced:
                    with dispatch.force(backward=bwd):
                        fwd_ms = do_bench(lambda: triflash.flash_attn_func(q.detach(), k.detach(), v.detach(),
                                                                           causal=True, **kw),
                                          warmup=25, rep=150, return_mode="median")
                        o = triflash.flash_attn_func(q, k, v, causal=True, **kw)
                        bwd_ms = do_bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                                          warmup=25, rep=150, return_mode="median")
                    rows.append((d, str(dt).split(".")[-1], name + (f" bwd={bwd}" if bwd else ""), fwd_ms, bwd_ms))
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print(f"{'tree':8} {'D':>3} {'dtype':9} {'variant':20} {'fwd ms':>8} {'bwd ms':>8}")
    for d, dt, name, f, b in rows:
        print(f"{tag:8} {d:>3} {dt:9} {name:20} {f:8.4f} {b:8.4f}")


if __name__ == "__main__":
    main()

"""Run one Gluon forward variant at one shape a few times, for a profiler (ncu) to attach to.

    PYTHONPATH=src python3 scripts/profile_forward.py --variant pp_persist --shape 4 16 4096 64 [--causal]
    ncu --clock-control none -k regex:attn_fwd_hopper --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section InstructionStats python3 scripts/profile_forward.py ...
    (--fa4: FlashAttention-4's forward instead; ncu -k regex:[Ff]lash)
"""

import argparse

import torch

from triflash.kernels import forward_hopper as FH


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="pp_persist")
    ap.add_argument("--shape", nargs=4, type=int, default=[4, 16, 4096, 64], metavar=("B", "H", "S", "D"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--fa4", action="store_true",
                    help="run FlashAttention-4 (flash_attn.cute.flash_attn_func) instead, for the same "
                         "profile of the peer (ncu -k regex:[Ff]lash)")
    a = ap.parse_args()
    b, h, s, d = a.shape
    dtype = getattr(torch, a.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    if a.fa4:
        from flash_attn.cute import flash_attn_func

        def run():
            flash_attn_func(q, k, v, softmax_scale=d ** -0.5, causal=a.causal)
    else:
        def run():
            FH.forward_hopper(q, k, v, d ** -0.5, a.causal, variant=a.variant)
    for _ in range(a.iters):
        run()
    torch.cuda.synchronize()
    print(f"ran {'fa4' if a.fa4 else a.variant} {a.shape} causal={a.causal} x{a.iters}")


if __name__ == "__main__":
    main()

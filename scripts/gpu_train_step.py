"""Forward, backward and forward+backward through ``flash_attn_func`` (autograd), with the backward
chooser as it is and with the Triton backward kernels forced, timed side by side in interleaved
rounds, SDPA's cuDNN backend beside them.

Why: the fused Hopper backward (backward_hopper.py) was chosen from backward-only timings (the
forward's out and lse given). In training a forward kernel runs right before it. This checks that the
pick holds there too.

    PYTHONPATH=src python3 scripts/gpu_train_step.py [--rounds 5] [--out $OUT/train_step.json]

Shapes: --shapes B,H,S,D,causal|full[,fp16|bf16] ... (default: four fp16 shapes at head_dim 64).
Gradients of both backward paths are compared with each other (and out with SDPA's) before timing.
TFLOP/s: forward 4 * B * H * S^2 * D (halved causal), backward 2.5x that, fwd+bwd 3.5x.
"""

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

import triflash
from triflash.kernels import configs

SHAPES = ["4,16,4096,64,causal", "4,16,4096,64,full", "2,16,8192,64,causal", "1,16,16384,64,causal"]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def parse_shape(text: str):
    """"B,H,S,D,causal|full[,fp16|bf16]" -> (B, H, S, D, causal, dtype)."""
    parts = text.split(",")
    b, h, s, d = map(int, parts[:4])
    return b, h, s, d, parts[4] == "causal", DTYPES[parts[5] if len(parts) > 5 else "fp16"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="B,H,S,D,causal|full[,fp16|bf16]")
    ap.add_argument("--out", default="train_step.json")
    a = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}",
          flush=True)
    chooser = configs.hopper_backward_variant
    paths = {"chooser": chooser, "triton-bwd": lambda **kw: None, "fused-bwd": lambda **kw: "split"}
    rows = []
    for b, h, s, d, causal, dtype in map(parse_shape, a.shapes):
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        do = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        picked = chooser(head_dim=d, dtype=q.dtype, device=q.device, causal=causal, seqlen_q=s,
                         seqlen_k=s)

        def fwd():
            return triflash.flash_attn_func(q, k, v, causal=causal)

        grads = {}
        for name, fn in paths.items():
            configs.hopper_backward_variant = fn
            grads[name] = torch.autograd.grad(fwd(), (q, k, v), do)
        configs.hopper_backward_variant = chooser
        diff = max((x - y).abs().max().item() for x, y in zip(grads["triton-bwd"], grads["fused-bwd"]))
        qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
        out_err = (fwd().detach() - ref).abs().max().item()
        print(f"B{b} H{h} S{s} D{d} {dtype} causal={causal}: chooser picks {picked}; |dq,dk,dv fused - triton| "
              f"max {diff:.2e}; |out - cuDNN| {out_err:.2e}", flush=True)
        if not (diff < (5e-2 if dtype == torch.float16 else 2e-1) and out_err < 2e-2):
            print("  MISMATCH: not timed", flush=True)
            continue

        qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        dos = do.transpose(1, 2)

        def sdpa_fwd():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)

        out_keep = {}
        tasks = {}
        for name, fn in paths.items():
            def make(fn=fn, name=name):
                def bwd_only():
                    configs.hopper_backward_variant = fn
                    try:
                        torch.autograd.grad(out_keep[name], (q, k, v), do, retain_graph=True)
                    finally:
                        configs.hopper_backward_variant = chooser

                def fwd_bwd():
                    configs.hopper_backward_variant = fn
                    try:
                        torch.autograd.grad(fwd(), (q, k, v), do)
                    finally:
                        configs.hopper_backward_variant = chooser
                return bwd_only, fwd_bwd
            out_keep[name] = fwd()
            bo, fb = make()
            tasks[f"{name} bwd"] = (bo, 2.5)
            tasks[f"{name} fwd+bwd"] = (fb, 3.5)
        sdpa_out = sdpa_fwd()
        tasks["cudnn bwd"] = (lambda: torch.autograd.grad(sdpa_out, (qs, ks, vs), dos, retain_graph=True), 2.5)
        tasks["cudnn fwd+bwd"] = (lambda: torch.autograd.grad(sdpa_fwd(), (qs, ks, vs), dos), 3.5)
        tasks["triflash fwd"] = (lambda: triflash.flash_attn_func(q.detach(), k.detach(), v.detach(),
                                                                  causal=causal), 1.0)
        times = {n: [] for n in tasks}
        for _ in range(a.rounds):
            for n, (fn, _) in tasks.items():
                times[n].append(triton.testing.do_bench(fn, warmup=25, rep=100))
        for n, (fn, mult) in tasks.items():
            ms = statistics.median(times[n])
            rows.append(dict(shape=f"{b},{h},{s},{d}", dtype=str(dtype).split(".")[-1], causal=causal, task=n, ms=ms,
                             tflops=mult * flops / ms * 1e-9, spread=[min(times[n]), max(times[n])],
                             picked=picked))
        del q, k, v, do, grads, out_keep, sdpa_out, qs, ks, vs
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n| B,H,S,D | dtype | causal | task | ms (median of {a.rounds}) | TFLOP/s | min-max ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['dtype']} | {r['causal']} | {r['task']} | {r['ms']:.3f} | {r['tflops']:.1f} | "
              f"{r['spread'][0]:.3f}-{r['spread'][1]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

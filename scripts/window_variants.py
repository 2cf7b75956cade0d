"""Which forward kernel for causal local windows on Hopper: each Gluon variant forced against the Triton
kernel (dispatch.forward_variant's window rule comes from this). GPU only; bf16, do_bench medians;
prints one line per workload: variant, ms, TFLOP/s over the visible scores, max |diff| to Triton's output.

    PYTHONPATH=src python3 scripts/window_variants.py
"""
import torch
import triton

import triflash
from triflash.kernels import dispatch, forward_hopper

# (head dim, batch, heads, seqlen, window left) with right = 0, causal.
ROWS = [(64, 4, 16, 8192, w) for w in (256, 512, 1024, 2048, 4096)] + \
       [(128, 2, 32, 16384, w) for w in (512, 1024, 4096)] + [(128, 4, 16, 8192, 1024)]


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for d, b, h, s, w in ROWS:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * d * sum(min(i + 1, w + 1) for i in range(s))
        ref, row = None, [f"D{d} B{b} H{h} S{s} window ({w}, 0)"]
        variants = [n for n, dims in forward_hopper.VARIANTS.items() if d in dims and "ltc" not in n]
        for variant in ["triton", *variants]:
            with dispatch.force(forward=variant):
                def call():
                    return triflash.flash_attn_func(q, k, v, causal=True, window_size=(w, 0))
                out = call()
                ref = out if ref is None else ref
                diff = (out.float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench(call, warmup=25, rep=60)
            row.append(f"{variant} {ms:.3f} ms {flops / ms / 1e9:.0f} TF diff {diff:.0e}")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()

"""Where the single-launch backward pays (dispatch.SINGLE_MAX_WORK comes from this). GPU only.

Two tables, peers in the same run:

* ``gpu``: the backward alone (``dispatch.backward`` on a forward's out / lse), the single launch
  against the three launches the chooser takes without it: CUDA-graph replays (the kernels' time)
  and eager ``do_bench`` medians (what a loop sees), with the largest difference between the two
  results. The single launch pays where its kernel time stays below the host time it saves.
* ``host``: host microseconds per call (``triflash.bench.host.host_us``: 9 loops of 100 calls, the
  GPU kept busy) of the forward recording autograd and of forward + backward, for triflash with and
  without the single launch (call plans on, as users get them) and for SDPA's flash and cuDNN
  backends; and the eager time per forward + backward (do_bench).

    PYTHONPATH=src python3 scripts/single_launch.py [gpu|host|all]
"""
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

import triflash
from triflash.bench.host import host_us
from triflash.kernels import dispatch, launch

LIMIT = dispatch.SINGLE_MAX_WORK
# The rule's limit while measuring the single launch (the shipped one may be lower, or 0).
MEASURE_LIMIT = max(LIMIT, 1 << 40)
GPU_ROWS = [(1, 128, 8, 64), (2, 512, 16, 64), (2, 512, 16, 128), (4, 512, 16, 128), (4, 1024, 16, 64),
            (2, 1024, 16, 128), (8, 1024, 16, 128), (2, 2048, 16, 128)]
HOST_ROWS = [(1, 128, 8, 64), (2, 512, 16, 128), (8, 1024, 16, 128)]


def tensors(batch, seqlen, heads, dim, dtype=torch.float16, grad=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=dtype, generator=g).requires_grad_(grad)
            for _ in range(4)]


def gpu_table():
    print("\n| B,S,H,D | causal | work | single graph us | three graph us | single eager us | three eager us "
          "| max diff |")
    print("|---|---|---|---|---|---|---|---|")
    for batch, seqlen, heads, dim in GPU_ROWS:
        for causal in (True, False):
            q, k, v, dout = tensors(batch, seqlen, heads, dim)
            scale = dim ** -0.5
            out, lse = dispatch.forward(q, k, v, scale, causal)
            res = {}
            for name, limit in (("single", MEASURE_LIMIT), ("three", -1)):
                dispatch.SINGLE_MAX_WORK = limit

                def call():
                    return dispatch.backward(dout, q, k, v, out, lse, scale, causal)
                grads = call()
                res[name] = (grads, do_bench_cudagraph(call, rep=30) * 1e3, do_bench(call, warmup=10, rep=50) * 1e3)
            dispatch.SINGLE_MAX_WORK = LIMIT
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(res["single"][0], res["three"][0]))
            work = batch * heads * seqlen * seqlen * dim // (2 if causal else 1)
            print(f"| {batch},{seqlen},{heads},{dim} | {causal} | {work:.2e} | {res['single'][1]:.1f} | "
                  f"{res['three'][1]:.1f} | {res['single'][2]:.1f} | {res['three'][2]:.1f} | {diff:.1e} |", flush=True)


def host_table():
    print("\n| B,S,H,D | dtype | provider | fwd grad host us | fwd+bwd host us | fwd+bwd eager us |")
    print("|---|---|---|---|---|---|")
    for batch, seqlen, heads, dim in HOST_ROWS:
        for dtype in (torch.float16, torch.bfloat16):
            q, k, v, dout = tensors(batch, seqlen, heads, dim, dtype, grad=True)
            qt, kt, vt, dt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v, dout))

            def tf_fwd():
                triflash.flash_attn_func(q, k, v, causal=True)

            def tf_step():
                torch.autograd.grad(triflash.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)

            def sdpa_fwd():
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

            def sdpa_step():
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                torch.autograd.grad(out, (qt, kt, vt), dt)
            rows = []
            for name, limit in (("triflash, single launch", MEASURE_LIMIT), ("triflash, three launches", -1)):
                dispatch.SINGLE_MAX_WORK = limit
                launch.clear_plans()
                rows.append((name, host_us(tf_fwd, 100, 9)[0], host_us(tf_step, 100, 9)[0],
                             do_bench(tf_step, warmup=25, rep=200) * 1e3))
            dispatch.SINGLE_MAX_WORK = LIMIT
            launch.clear_plans()
            sdpa = (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION))
            for name, backend in sdpa:
                with sdpa_kernel(backend):
                    rows.append((name, host_us(sdpa_fwd, 100, 9)[0], host_us(sdpa_step, 100, 9)[0],
                                 do_bench(sdpa_step, warmup=25, rep=200) * 1e3))
            for name, fwd, step, eager in rows:
                print(f"| {batch},{seqlen},{heads},{dim} | {str(dtype)[6:]} | {name} | {fwd:.1f} | {step:.1f} | "
                      f"{eager:.1f} |", flush=True)


def main():
    part = sys.argv[1] if len(sys.argv) > 1 else "all"
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    if part in ("host", "all"):
        host_table()
    if part in ("gpu", "all"):
        gpu_table()


if __name__ == "__main__":
    main()

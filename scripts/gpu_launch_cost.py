"""Where a short training call's host time goes: each piece of the path timed on its own.

Every item is timed the way ``gpu_host_time.py`` times a whole call: the GPU first gets a long
``torch.cuda._sleep``, so nothing waits for it, then ``n`` calls run on the host clock (the least of 7
repeats, microseconds per call). Pieces: tensor allocation, argument checks, an empty Triton launch
with few and with many arguments, the forward and backward launchers, Triton's launch of the Gluon
forward kernel against a direct call of the compiled kernel (Triton's binder and cache lookup
skipped), the autograd engine on a trivial Function, and the public calls.

    PYTHONPATH=src python3 scripts/gpu_launch_cost.py [--shape B,H,S,D,causal|full] [--out FILE]
"""

import argparse
import json
import sys
import time

import torch
import triton
import triton.language as tl

import triflash
from triflash.api import validate_qkv
from triflash.kernels import backward as bwd_mod
from triflash.kernels import configs
from triflash.kernels import forward as fwd_mod
from triflash.kernels import forward_hopper


@triton.jit
def _empty_kernel(X):
    pass


@triton.jit
def _empty_kernel_many(X, Y, Z, W, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14,
                       a15, s0, s1, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr):
    pass


def host_us(fn, n: int = 50, repeats: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return min(times)          # a shared host: interruptions only add time (see gpu_host_time.py)


def _launch_arguments(module, name, call):
    """(grid, args, kwargs) of the launch of ``module.name`` that ``call()`` makes: the launcher's
    own arguments, recorded while it runs, so the timings below never drift from it."""
    real, calls = getattr(module, name), []

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append((grid, args, kwargs))
                return real[grid](*args, **kwargs)
            return launch

    setattr(module, name, Recording())
    try:
        call()
    finally:
        setattr(module, name, real)
    return calls[0]


class _Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, d):
        return d, d, d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2,4,4096,128,causal")
    ap.add_argument("--out", default="launch_cost.json")
    a = ap.parse_args(argv)
    parts = a.shape.split(",")
    b, h, s, d = map(int, parts[:4])
    causal = parts[4] == "causal"
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"shape {a.shape}", flush=True)
    q, k, v, do = (torch.randn(b, s, h, d, device=dev, dtype=torch.float16) for _ in range(4))
    scale = d ** -0.5
    x = torch.empty(16, device=dev)
    out, lse = fwd_mod.forward(q, k, v, scale, causal)
    variant = configs.hopper_forward_variant(head_dim=d, dtype=q.dtype, device=dev, causal=causal,
                                             seqlen_q=s, seqlen_k=s)
    items = {}

    def item(name, fn, n=50):
        try:
            items[name] = host_us(fn, n)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next piece
            print(f"{name:58s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return
        print(f"{name:58s} {items[name]:8.1f} us", flush=True)

    item("torch.empty (one [B,S,H,D])", lambda: torch.empty(q.shape, dtype=q.dtype, device=dev))
    item("validate_qkv", lambda: validate_qkv(q, k, v, "bshd", "softmax_scale", None, causal))
    item("configs.hopper_forward_variant",
         lambda: configs.hopper_forward_variant(head_dim=d, dtype=q.dtype, device=dev, causal=causal,
                                                seqlen_q=s, seqlen_k=s))
    item("empty Triton kernel, 1 pointer", lambda: _empty_kernel[(1,)](x))
    ints = list(range(3, 19))
    item("empty Triton kernel, 4 pointers + 18 ints + 3 constexprs",
         lambda: _empty_kernel_many[(1,)](x, x, x, x, *ints, 2.0, 3.0, B0=16, B1=32, B2=True))
    item("forward launcher (kernels.forward.forward)", lambda: fwd_mod.forward(q, k, v, scale, causal))
    item("forward launcher, Triton kernel forced",
         lambda: fwd_mod.forward(q, k, v, scale, causal,
                                 config=configs.forward_config(head_dim=d, dtype=q.dtype, causal=causal,
                                                               batch_heads=b * h, seqlen_q=s, device=dev)))
    if variant is not None:
        cfg = forward_hopper.variant_config(variant, d)
        item("Gluon forward: 4 descriptors built", lambda: [forward_hopper._descriptor(t, cfg["rows"], d)
                                                            for t in (q, k, v, out)])
        grid, args, kw = _launch_arguments(forward_hopper, "_attn_fwd_hopper_kernel",
                                           lambda: fwd_mod.forward(q, k, v, scale, causal))
        kernel = forward_hopper._attn_fwd_hopper_kernel
        compiled = kernel[grid](*args, **kw)
        item("Gluon forward: kernel[grid](...) (Triton's launch)", lambda: kernel[grid](*args, **kw))
        binder = kernel.device_caches[dev.index if dev.index is not None else 0][4]
        bound, _, _ = binder(*args, **kw)
        values = list(bound.values())
        stream = triton.runtime.driver.active.get_current_stream(torch.cuda.current_device())

        def direct():
            # The tail of JITFunction.run (Triton 3.6), launch hooks and their metadata included.
            compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata(grid, stream, *values),
                         triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook,
                         *values)

        item("Gluon forward: compiled.run(...) (binder + cache lookup skipped)", direct)
        item("Gluon forward: binder(...) alone", lambda: binder(*args, **kw))
    item("flash_attn_func, no graph (direct road)", lambda: triflash.flash_attn_func(q, k, v, causal=causal))
    item("backward launcher (kernels.backward.backward)",
         lambda: bwd_mod.backward(do, q, k, v, out, lse, scale, causal), n=20)
    item("backward preprocess only",
         lambda: bwd_mod.preprocess(do, out, lse, None, s, False), n=20)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    item("autograd engine, trivial Function: fwd + grad",
         lambda: torch.autograd.grad(_Trivial.apply(qg, kg, vg), (qg, kg, vg), do))
    o = triflash.flash_attn_func(qg, kg, vg, causal=causal)
    item("flash_attn_func backward: autograd.grad (retain_graph)",
         lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True), n=20)
    item("flash_attn_func fwd + bwd",
         lambda: torch.autograd.grad(triflash.flash_attn_func(qg, kg, vg, causal=causal), (qg, kg, vg), do),
         n=20)
    qs, ks, vs, dos = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    qs, ks, vs = (t.requires_grad_() for t in (qs, ks, vs))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        item("SDPA cuDNN fwd + bwd",
             lambda: torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
                 qs, ks, vs, is_causal=causal), (qs, ks, vs), dos), n=20)
    with open(a.out, "w") as f:
        json.dump(dict(shape=a.shape, items=items), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

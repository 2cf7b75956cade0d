"""The backward's Gluon variants side by side in one process: each variant forced through the
launcher (its ``hopper`` argument), the chooser as users get it, and SDPA's cuDNN backward, in
interleaved rounds of do_bench medians.

Before timing, every forced variant must give the same gradients twice in a row (no atomics: bit for
bit), and its gradients are compared with the first variant's (printed as the largest relative
difference of dQ, dK, dV) and with cuDNN's (printed).

    PYTHONPATH=src python3 scripts/gpu_backward_picks.py [--variants dkdv dkdv_long]
        [--shapes 2,16,8192,64 ...] [--rounds 5] [--dtype float16]
"""
import argparse

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from triflash.kernels import configs
from triflash.kernels.backward import backward
from triflash.kernels.forward import forward

ap = argparse.ArgumentParser()
ap.add_argument("--variants", nargs="*", default=["dkdv", "dkdv_long"])
ap.add_argument("--shapes", nargs="*", default=["4,16,4096,64", "2,16,8192,64", "1,16,16384,64",
                                                 "1,32,16384,64"])
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--dtype", default="float16")
a = ap.parse_args()
dtype = getattr(torch, a.dtype)


def forced(variant):
    """The launcher with the Gluon variant forced (None: the chooser's pick)."""
    return lambda do, q, k, v, out, lse, scale, causal: backward(do, q, k, v, out, lse, scale, causal,
                                                                 hopper=variant)


print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
      f"cudnn {torch.backends.cudnn.version()} {a.dtype}", flush=True)
for shape in a.shapes:
    b, h, s, d = (int(x) for x in shape.split(","))
    for causal in (False, True):
        torch.manual_seed(0)
        q = torch.randn(b, s, h, d, dtype=dtype, device="cuda")
        k, v, do = (torch.randn_like(q) for _ in range(3))
        scale = d ** -0.5
        out, lse = forward(q, k, v, scale, causal)
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        pick = configs.hopper_backward_variant(head_dim=d, dtype=dtype, device=q.device, causal=causal,
                                               seqlen_q=s, seqlen_k=s)
        fns = {f"{v}": forced(v) for v in a.variants}
        fns[f"chooser ({pick})"] = forced(None)
        qh, kh, vh, doh = (t.transpose(1, 2).detach().requires_grad_(t is not do) for t in (q, k, v, do))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o_ref = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)

        def cudnn():
            return torch.autograd.grad(o_ref, (qh, kh, vh), doh, retain_graph=True)
        ref_cudnn = [g.transpose(1, 2) for g in cudnn()]
        first = None
        notes = []
        for name, fn in fns.items():
            g1 = fn(do, q, k, v, out, lse, scale, causal)
            g2 = fn(do, q, k, v, out, lse, scale, causal)
            assert all(torch.equal(x, y) for x, y in zip(g1, g2)), f"{name}: not deterministic"
            first = first or g1
            rel = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                      for x, y in zip(g1, first))
            rel_c = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                        for x, y in zip(g1, ref_cudnn))
            notes.append(f"{name}: vs first {rel:.1e}, vs cuDNN {rel_c:.1e}")
        fns["cudnn"] = lambda *args: cudnn()
        names = list(fns)
        per = {n: [] for n in names}
        for r in range(a.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                call = fns[n]
                per[n].append(triton.testing.do_bench(lambda: call(do, q, k, v, out, lse, scale, causal),
                                                      warmup=25, rep=100, return_mode="median"))
        cells = "  ".join(f"{n}: {flops / sorted(per[n])[len(per[n]) // 2] / 1e9:6.1f}" for n in names)
        print(f"{b},{h},{s},{d} {'causal' if causal else 'full  '} {cells}", flush=True)
        print("    " + "; ".join(notes), flush=True)

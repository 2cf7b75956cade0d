"""A/B of the Gluon backward in one process: the backward through triflash's launcher with
kernels/backward_hopper.py as it is (A) and with another version of that file (B, e.g. main's, saved
with `git show main:src/triflash/kernels/backward_hopper.py > /tmp/old.py`), five interleaved rounds
of do_bench medians each, cuDNN beside them. Each must give the same gradients twice in a row
(asserted); the largest difference between A's and B's is printed. B is loaded inside
triflash.kernels, so its relative imports take today's forward_hopper and configs: B must call
their helpers with today's signatures (a file from before 5c62e77, or from before 360295d, which
added its section argument, calls an older _tile_coords).

    PYTHONPATH=src python3 scripts/gpu_ab_backward.py path/to/other/backward_hopper.py
"""
import importlib.util
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
import triflash.kernels as K
from triflash.kernels import backward_hopper as A
from triflash.kernels.backward import backward
from triflash.kernels.forward import forward

alt_path = sys.argv[1]
spec = importlib.util.spec_from_file_location("triflash.kernels.backward_hopper_alt", alt_path)
B = importlib.util.module_from_spec(spec)
B.__package__ = "triflash.kernels"
spec.loader.exec_module(B)
mods = {"A": A, "B": B}


def use(m):
    """Make the launcher's ``from . import backward_hopper`` find module m."""
    sys.modules["triflash.kernels.backward_hopper"] = m
    K.backward_hopper = m


print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} cudnn {torch.backends.cudnn.version()}")
print(f"A = src backward_hopper, B = {alt_path}")
shapes = [(4, 16, 4096, 64), (16, 32, 1024, 64), (4, 16, 4096, 128), (1, 16, 16384, 128), (16, 16, 1024, 128)]
for (b, h, s, d) in shapes:
    for causal in (False, True):
        torch.manual_seed(0)
        q = torch.randn(b, s, h, d, dtype=torch.float16, device="cuda")
        k, v, do = (torch.randn_like(q) for _ in range(3))
        scale = d ** -0.5
        out, lse = forward(q, k, v, scale, causal)
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        grads = {}
        for name, m in mods.items():
            use(m)
            g1 = backward(do, q, k, v, out, lse, scale, causal)
            g2 = backward(do, q, k, v, out, lse, scale, causal)
            assert all(torch.equal(x, y) for x, y in zip(g1, g2)), f"{name} not deterministic"
            grads[name] = g1
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(grads["A"], grads["B"]))
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
        dot = do.transpose(1, 2)
        fns = {"cudnn": lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)}
        for name, m in mods.items():
            fns[name] = (lambda m=m: (use(m), backward(do, q, k, v, out, lse, scale, causal)))
        per = {n: [] for n in fns}
        names = list(fns)
        for r in range(5):
            for n in names[r % 3:] + names[:r % 3]:
                per[n].append(triton.testing.do_bench(fns[n], warmup=25, rep=150, return_mode="median"))
        res = {n: flops / (sorted(v)[2] * 1e-3) / 1e12 for n, v in per.items()}
        line = (f"{b},{h},{s},{d} {'causal' if causal else 'full  '} A {res['A']:6.1f}  B {res['B']:6.1f}  "
                f"B/A {res['B'] / res['A']:.3f}  cudnn {res['cudnn']:6.1f}  max|A-B| {diff:.1e}  rounds A "
                + " ".join(f"{flops / (x * 1e-3) / 1e12:.0f}" for x in per['A']) + "  B "
                + " ".join(f"{flops / (x * 1e-3) / 1e12:.0f}" for x in per['B']))
        print(line, flush=True)

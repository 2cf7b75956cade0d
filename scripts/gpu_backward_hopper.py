"""GPU run for the Gluon backward (src/triflash/kernels/backward_hopper.py): correctness and
determinism of each variant first, then timing beside the Triton backward kernels (forced: not the
chooser's pick) and SDPA's backends.

    PYTHONPATH=src python3 scripts/gpu_backward_hopper.py [--variants dkdv split ...] [--skip-check]
        [--watchdog 240]

Correctness, per case: dQ, dK, dV each within 3x the error of PyTorch's own same-dtype attention
backward against a float64 reference, plus the test suite's relative floor (tests/test_backward.py's
rule); no NaN; and two more runs on the same inputs give torch.equal gradients. The Triton backward's
errors are printed beside them.
Timing: triton.testing.do_bench medians of the backward alone (the forward's out and lse given),
TFLOP/s = 2.5 * 4 * B * H * S^2 * D / t, halved for causal.

A watchdog thread ends the process (printing the case it was on) if a case hangs, so a deadlock costs
minutes, not the whole call. Full logs go to $OUT when set.
"""

import argparse
import json
import os
import sys
import threading
import time

import torch
import triton

from triflash.kernels import backward_hopper as BH
from triflash.kernels.backward import backward
from triflash.kernels.configs import backward_config
from triflash.kernels.forward import forward
from triflash.reference import flash_attn_ref

LOG = []
STATE = {"case": "start", "t": time.time()}
FLOOR = {torch.float16: 2.0**-12, torch.bfloat16: 2.0**-9}


def log(msg=""):
    print(msg, flush=True)
    LOG.append(msg)


def watchdog(limit):
    def run():
        while True:
            time.sleep(2)
            if time.time() - STATE["t"] > limit:
                log(f"WATCHDOG: case '{STATE['case']}' ran over {limit}s (deadlock?); exiting")
                flush()
                os._exit(3)
    threading.Thread(target=run, daemon=True).start()


def flush():
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_backward_hopper.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")


def step(name):
    STATE["case"], STATE["t"] = name, time.time()


def ref_grads(q, k, v, do, causal, dtype):
    leaves = [t.detach().to(dtype if dtype is not None else t.dtype).requires_grad_() for t in (q, k, v)]
    out = flash_attn_ref(*leaves, causal=causal, compute_dtype=dtype)
    out.backward(do.to(out.dtype))
    return [t.grad for t in leaves]


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def backward_as(do, q, k, v, out, lse, scale, causal, variant):
    """The backward with the Gluon ``variant``, or with the Triton kernels when it is None (an explicit
    tile config keeps the chooser out: hopper=None alone would let it pick a Gluon variant)."""
    if variant is None:
        cfg = backward_config(head_dim=q.shape[-1], dtype=q.dtype, device=q.device)
        return backward(do, q, k, v, out, lse, scale, causal, config=cfg)
    return backward(do, q, k, v, out, lse, scale, causal, hopper=variant)


def run_backward(q, k, v, do, causal, variant):
    scale = q.shape[-1] ** -0.5
    out, lse = forward(q, k, v, scale, causal)
    return backward_as(do, q, k, v, out, lse, scale, causal, variant)


def check(variants, quick=False):
    shapes = [
        # B, Sq, Sk, Hq, Hkv
        (2, 1000, 1000, 4, 4),
        (1, 1000, 1500, 8, 2),
        (1, 1500, 1000, 4, 1),
        (2, 1, 300, 4, 4),
        (1, 77, 77, 2, 2),
        (1, 4096 + 13, 4096 + 13, 2, 1),
        (1, 130, 64, 2, 2),
        (2, 512, 512, 6, 2),
    ]
    if quick:
        shapes = [shapes[1], shapes[5], shapes[6]]
    ok_variants = [v for v in variants if v in BH.EXPERIMENTS]     # wrong dQ on purpose: timing only
    for variant in variants:
        if variant in BH.EXPERIMENTS:
            continue
        failures = 0
        for d in sorted(BH.VARIANTS[variant]):
            for dtype in (torch.float16,) if quick else (torch.float16, torch.bfloat16):
                for causal in (False, True):
                    for b, sq, sk, hq, hkv in shapes:
                        label = f"{variant} D{d} {str(dtype)[6:]} {'causal' if causal else 'full'} " \
                                f"B{b} Sq{sq} Sk{sk} H{hq}/{hkv}"
                        step(label)
                        torch.manual_seed(0)
                        q = torch.randn(b, sq, hq, d, dtype=dtype, device="cuda")
                        k = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
                        v = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
                        do = torch.randn(b, sq, hq, d, dtype=dtype, device="cuda")
                        try:
                            got = run_backward(q, k, v, do, causal, variant)
                            torch.cuda.synchronize()
                            again = [run_backward(q, k, v, do, causal, variant) for _ in range(2)]
                            torch.cuda.synchronize()
                        except Exception as e:  # noqa: BLE001
                            log(f"  FAIL {label}: {type(e).__name__}: {str(e)[:300]}")
                            failures += 1
                            continue
                        tri = run_backward(q, k, v, do, causal, None)
                        r64 = ref_grads(q, k, v, do, causal, torch.float64)
                        same = ref_grads(q, k, v, do, causal, None)
                        floor = FLOOR[dtype] * max(1.0, max(r.abs().max().item() for r in r64))
                        msgs, bad = [], False
                        for name, g, t, r, s in zip(("dq", "dk", "dv"), got, tri, r64, same):
                            if torch.isnan(g).any():
                                bad = True
                                msgs.append(f"{name} NaN")
                                continue
                            err, base, terr = max_err(g, r), max_err(s, r), max_err(t, r)
                            lim = 3 * base + floor
                            bad |= err > lim
                            msgs.append(f"{name} {err:.2e}/{lim:.2e} (triton {terr:.2e})")
                        det = all(torch.equal(x, y) for a in again for x, y in zip(a, got))
                        bad |= not det
                        log(f"  {'FAIL' if bad else 'ok  '} {label}: {'; '.join(msgs)}; "
                            f"{'deterministic' if det else 'NOT DETERMINISTIC'}")
                        failures += bad
        log(f"variant {variant}: {failures} failures")
        if failures == 0:
            ok_variants.append(variant)
    return ok_variants


def bench(variants, head_dims):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    rows = []
    shapes = [(4, 16, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128), (16, 32, 1024, 64),
              (16, 16, 1024, 128)]
    for b, h, s, d in [sh for sh in shapes if sh[3] in head_dims]:
        for causal in (False, True):
            flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
            torch.manual_seed(0)
            q = torch.randn(b, s, h, d, dtype=torch.float16, device="cuda")
            k = torch.randn_like(q)
            v = torch.randn_like(q)
            do = torch.randn_like(q)
            scale = d ** -0.5
            out, lse = forward(q, k, v, scale, causal)
            row = {"shape": f"{b},{h},{s},{d}", "causal": causal}
            providers = [("triton", None)] + [(v_, v_) for v_ in variants if d in BH.VARIANTS[v_]]
            for name, var in providers:
                step(f"bench {name} {row}")
                fn = lambda var=var: backward_as(do, q, k, v, out, lse, scale, causal, var)  # noqa: E731
                ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
                row[name] = flops / ms / 1e9
            qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
                step(f"bench {name} {row}")
                try:
                    with sdpa_kernel(backend):
                        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    dot = do.transpose(1, 2)
                    fn = lambda o=o, dot=dot: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)  # noqa: E731
                    ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
                    row[name] = flops / ms / 1e9
                except Exception as e:  # noqa: BLE001
                    row[name] = None
                    log(f"  {name}: {type(e).__name__}: {str(e)[:120]}")
            rows.append(row)
            log("  " + json.dumps({k_: (round(v_, 1) if isinstance(v_, float) else v_) for k_, v_ in row.items()}))
            flush()
    names = ["triton"] + variants + ["cudnn", "sdpa-flash"]
    log("\nbwd TFLOP/s (fp16)")
    log(f"{'shape':<16} {'causal':<6} " + " ".join(f"{n:>11}" for n in names))
    for r in rows:
        log(f"{r['shape']:<16} {str(r['causal']):<6} "
            + " ".join(f"{r[n]:11.1f}" if r.get(n) else f"{'-':>11}" for n in names))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="*", default=list(BH.VARIANTS))
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--quick-check", action="store_true", help="check fp16 and three shapes only")
    ap.add_argument("--watchdog", type=float, default=240)
    ap.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    a = ap.parse_args()
    watchdog(a.watchdog)
    log(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
        f"cudnn {torch.backends.cudnn.version()}")
    variants = a.variants if a.skip_check else check(a.variants, a.quick_check)
    flush()
    if variants:
        rows = bench(variants, a.head_dims)
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "gpu_backward_hopper.json"), "w") as f:
                json.dump(rows, f, indent=1)
    flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

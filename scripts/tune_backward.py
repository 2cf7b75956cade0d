"""Try backward-kernel configs on the GPU (dK/dV and dQ separately), beside SDPA's backends.

Each candidate is checked against the fp32 reference gradients on the same inputs, then timed with
triton.testing.do_bench (median). Compiles run in parallel worker processes first.

    PYTHONPATH=src python3 scripts/tune_backward.py --out $OUT/tune_bwd.json
"""

import argparse
import itertools
import json
import multiprocessing as mp
import sys
import time

import torch
import triton

# (block_m, block_n, warps, stages, tma): pointer loads, and the same tiles with host-built TMA
# descriptors for the walked tiles (Q/dO in dK/dV, K/V in dQ).
_DKDV = [(32, 128, 4, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 4, 2), (32, 128, 8, 2),
         (64, 64, 4, 2), (128, 128, 8, 2)]
_DQ = [(128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3), (128, 64, 4, 2), (128, 32, 8, 2),
       (64, 64, 4, 2), (128, 128, 8, 2)]
DKDV = [c + (tma,) for c in _DKDV for tma in (False, True)]
DQ = [c + (tma,) for c in _DQ for tma in (False, True)]
# --quick: the four best of each from run 2, with and without descriptors.
QUICK_DKDV = [c + (tma,) for c in _DKDV[:4] for tma in (False, True)]
QUICK_DQ = [c + (tma,) for c in [_DQ[0], _DQ[1], _DQ[2], _DQ[6]] for tma in (False, True)]


def make(shape, dtype, seed=0):
    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(b, s, h, d, dtype=dtype, device="cuda", generator=g) for _ in range(4))
    return q, k, v, do


def run(args):
    shape, causal, which, cand = args
    from triflash.kernels.backward import backward
    from triflash.kernels.configs import BwdConfig
    from triflash.kernels.forward import forward

    q, k, v, do = make(shape, torch.float16)
    out, lse = forward(q, k, v, shape[3] ** -0.5, causal)
    cfg = (BwdConfig(*cand), BwdConfig(*cand))
    try:
        backward(do, q, k, v, out, lse, shape[3] ** -0.5, causal, config=cfg,
                 need_dq=which == "dq", need_dkdv=which == "dkdv")
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4,16,4096,64", "4,16,4096,128"])
    ap.add_argument("--out", default="tune_bwd.json")
    ap.add_argument("--budget", type=float, default=240)
    ap.add_argument("--quick", action="store_true", help="fewer tiles (QUICK_DKDV / QUICK_DQ)")
    a = ap.parse_args()
    dkdv_cands, dq_cands = (QUICK_DKDV, QUICK_DQ) if a.quick else (DKDV, DQ)
    t0 = time.time()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from triflash.kernels.backward import backward
    from triflash.kernels.configs import BwdConfig
    from triflash.kernels.forward import forward

    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes]
    jobs = [(s, c, w, cand) for s in shapes for c in (False, True)
            for w, cands in (("dkdv", dkdv_cands), ("dq", dq_cands)) for cand in cands]
    with mp.get_context("spawn").Pool(14) as pool:
        errs = pool.map(run, jobs)
    print(f"compiled {len(jobs)} backward variants in {time.time() - t0:.0f}s", flush=True)
    rows = []
    for shape, causal in itertools.product(shapes, (False, True)):
        b, h, s, d = shape
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        q, k, v, do = make(shape, torch.float16)
        scale = d ** -0.5
        out, lse = forward(q, k, v, scale, causal)
        # fp32 reference gradients via SDPA math on upcast inputs
        qf, kf, vf = (t.float().transpose(1, 2).requires_grad_() for t in (q, k, v))
        of = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal)
        ref = torch.autograd.grad(of, (qf, kf, vf), do.float().transpose(1, 2))
        ref = [r.transpose(1, 2) for r in ref]
        for be_name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
            try:
                with sdpa_kernel([be]):
                    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    ms = triton.testing.do_bench(lambda: torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2),
                                                                             retain_graph=True),
                                                 warmup=100, rep=400, return_mode="median")
                rows.append(dict(shape=shape, causal=causal, name=f"sdpa-{be_name}", ms=ms,
                                 tflops=flops / ms * 1e-9))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(shape=shape, causal=causal, name=f"sdpa-{be_name}", error=str(e)[:100]))
        for (js, jc, which, cand), err in zip(jobs, errs):
            if js != shape or jc != causal:
                continue
            name = f"{which}-M{cand[0]}-N{cand[1]}-w{cand[2]}-s{cand[3]}{'-tma' if cand[4] else ''}"
            row = dict(shape=shape, causal=causal, name=name, which=which)
            if err:
                row["error"] = err
            elif time.time() - t0 > a.budget:
                row["error"] = "skipped: budget"
            else:
                cfg = (BwdConfig(*cand), BwdConfig(*cand))
                kw = dict(config=cfg, need_dq=which == "dq", need_dkdv=which == "dkdv")
                dq, dk, dv = backward(do, q, k, v, out, lse, scale, causal, **kw)
                got = [dq] if which == "dq" else [dk, dv]
                want = [ref[0]] if which == "dq" else [ref[1], ref[2]]
                e = max((g.float() - r).abs().max().item() / max(1.0, r.abs().max().item())
                        for g, r in zip(got, want))
                row["err"] = e
                if not e < 2e-2:
                    row["error"] = f"WRONG {e:.3g}"
                else:
                    row["ms"] = triton.testing.do_bench(
                        lambda: backward(do, q, k, v, out, lse, scale, causal, **kw),
                        warmup=100, rep=400, return_mode="median")
            rows.append(row)
    json.dump(rows, open(a.out, "w"), indent=1)
    for shape, causal in itertools.product(shapes, (False, True)):
        b, h, s, d = shape
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        sel = [r for r in rows if tuple(r["shape"]) == shape and r["causal"] == causal]
        print(f"\n## bwd B,H,S,D={shape} causal={causal}")
        for r in sel:
            if r["name"].startswith("sdpa"):
                print(f"  {r['name']:<24} {r.get('tflops', 0):6.1f} TFLOP/s {r.get('ms', 0):7.3f} ms {r.get('error', '')}")
        best = {}
        for which in ("dkdv", "dq"):
            ok = sorted([r for r in sel if r.get("which") == which and "ms" in r], key=lambda r: r["ms"])
            for r in ok[:3]:
                print(f"  {r['name']:<24} {r['ms']:7.3f} ms  err {r['err']:.1e}")
            for r in [r for r in sel if r.get("which") == which and "error" in r][:4]:
                print(f"  FAIL {r['name']:<19} {r['error'][:100]}")
            if ok:
                best[which] = ok[0]["ms"]
        if len(best) == 2:
            ms = best["dkdv"] + best["dq"]
            print(f"  => best dkdv+dq {ms:.3f} ms = {flops / ms * 1e-9:.1f} TFLOP/s (preprocess counted twice)")
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    sys.exit(main())

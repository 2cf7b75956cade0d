"""Try forward-kernel configs on the GPU, side by side with SDPA's backends, and print a table.

Used to fill the chooser table in src/triflash/kernels/configs.py. Each config is first checked
against an fp32 reference on the same inputs, then timed with triton.testing.do_bench (median).
Compiles happen in parallel worker processes first (they fill Triton's on-disk cache), so the timing
pass only loads binaries.

    PYTHONPATH=src python3 scripts/tune_forward.py --out $OUT/tune.json [--shapes 4,16,4096,64 ...]
"""

import argparse
import itertools
import json
import multiprocessing as mp
import sys
import time

import torch
import triton

DEFAULT_SHAPES = ["4,16,4096,64", "4,16,4096,128", "16,16,1024,128"]


def candidates(head_dim):
    """(block_m, block_n, warps, stages, tma). Run 1 (docs/performance-notes.md) found host-built
    descriptors fastest (and Triton's warp specialization failing or slower), so the sweep is over
    host-descriptor tiles, with the pointer path at two tiles for reference."""
    out = []
    bns = [64, 128] if head_dim <= 128 else [32, 64]
    for bm, bn, w, s in itertools.product([128, 64], bns, [4, 8], [2, 3, 4]):
        if bm == 64 and w == 8:
            continue
        if head_dim > 128 and (s == 4 or bm == 128 and bn == 64 and w == 4):
            continue
        out.append((bm, bn, w, s, "host"))
    out += [(128, 64, 4, 3, "none"), (128, 64, 4, 2, "none")]
    return out


def make_inputs(shape, dtype, seed=0):
    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, dtype=dtype, device="cuda", generator=g) for _ in range(3)]


def run_cfg(args):
    shape, dtype_name, causal, cand = args
    from triflash.kernels.configs import FwdConfig
    from triflash.kernels.forward import forward

    dtype = getattr(torch, dtype_name)
    q, k, v = make_inputs(shape, dtype)
    cfg = FwdConfig(*cand[:4], tma=cand[4])
    try:
        forward(q, k, v, shape[3] ** -0.5, causal, config=cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - report every failure in the table
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def sdpa(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    with sdpa_kernel([be]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES)
    ap.add_argument("--dtypes", nargs="*", default=["float16"])
    ap.add_argument("--causal", nargs="*", default=["0", "1"])
    ap.add_argument("--out", default="tune.json")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds before the timing pass stops")
    a = ap.parse_args()
    t0 = time.time()
    print(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}",
          flush=True)
    jobs = []
    for shape_s, dtype_name, causal in itertools.product(a.shapes, a.dtypes, a.causal):
        shape = tuple(int(x) for x in shape_s.split(","))
        for cand in candidates(shape[3]):
            jobs.append((shape, dtype_name, causal == "1", cand))
    ctx = mp.get_context("spawn")
    with ctx.Pool(a.workers) as pool:
        errors = pool.map(run_cfg, jobs)
    print(f"compiled {len(jobs)} variants in {time.time() - t0:.0f}s", flush=True)

    from triflash.kernels.configs import FwdConfig
    from triflash.kernels.forward import forward

    rows = []
    groups = {}
    for job, err in zip(jobs, errors):
        groups.setdefault(job[:3], []).append((job[3], err))
    for (shape, dtype_name, causal), items in groups.items():
        b, h, s, d = shape
        dtype = getattr(torch, dtype_name)
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        q, k, v = make_inputs(shape, dtype)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(
            qt.float(), kt.float(), vt.float(), is_causal=causal).transpose(1, 2)
        peer = {}
        for be in ("flash", "cudnn", "efficient"):
            try:
                o = sdpa(qt, kt, vt, causal, be).transpose(1, 2)
                err = (o.float() - ref).abs().max().item()
                ms = triton.testing.do_bench(lambda: sdpa(qt, kt, vt, causal, be), warmup=100, rep=400,
                                             return_mode="median")
                peer[be] = (ms, err)
                rows.append(dict(shape=shape, dtype=dtype_name, causal=causal, name=f"sdpa-{be}", ms=ms,
                                 tflops=flops / ms * 1e-9, err=err))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(shape=shape, dtype=dtype_name, causal=causal, name=f"sdpa-{be}",
                                 error=str(e)[:100]))
        tol = 2 * max(e for _, e in peer.values()) + 1e-3 if peer else 1e-2
        for cand, cerr in items:
            name = "M{}-N{}-w{}-s{}-{}".format(*cand)
            row = dict(shape=shape, dtype=dtype_name, causal=causal, name=name)
            if cerr:
                row["error"] = cerr
            elif time.time() - t0 > a.budget:
                row["error"] = "skipped: time budget"
            else:
                cfg = FwdConfig(*cand[:4], tma=cand[4])
                out, _ = forward(q, k, v, d ** -0.5, causal, config=cfg)
                err = (out.float() - ref).abs().max().item()
                row["err"] = err
                if not err <= tol:
                    row["error"] = f"WRONG: max err {err:.3g} > {tol:.3g}"
                else:
                    ms = triton.testing.do_bench(lambda q=q, k=k, v=v: forward(q, k, v, d ** -0.5, causal, config=cfg),
                                                 warmup=50, rep=250, return_mode="median")
                    row.update(ms=ms, tflops=flops / ms * 1e-9)
            rows.append(row)
        del q, k, v, ref
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    # short table: per (shape, causal), peers then the 5 best configs, then failures
    for key in groups:
        sel = [r for r in rows if (tuple(r["shape"]), r["dtype"], r["causal"]) == key]
        ok = sorted([r for r in sel if "tflops" in r and not r["name"].startswith("sdpa")],
                    key=lambda r: -r["tflops"])
        print(f"\n## B,H,S,D={key[0]} {key[1]} causal={key[2]}")
        for r in [r for r in sel if r["name"].startswith("sdpa")] + ok[:6]:
            print(f"  {r['name']:<26} {r.get('tflops', 0):7.1f} TFLOP/s  {r.get('ms', 0):8.3f} ms  "
                  f"err {r.get('err', float('nan')):.2e} {r.get('error', '')}")
        fails = [r for r in sel if "error" in r and not r["name"].startswith("sdpa")]
        for r in fails[:8]:
            print(f"  FAIL {r['name']:<21} {r['error'][:110]}")
    print(f"total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

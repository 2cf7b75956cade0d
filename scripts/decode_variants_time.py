"""Decode with windows and score variants: the chooser's pick with ``dispatch.GLUON_DECODE_VARIANTS``
off (the Triton kernel) and on (the Gluon kernel where the chooser takes it: head dim 128, from 8k
keys, few programs), fp16, Hq 32, Hkv 8, one query token, caches full. For each point: which kernel
ran, the largest difference between the two outputs, and the median µs of eager calls and of
CUDA-graph replays (triton.testing.do_bench). The decision the switch waits for.

    PYTHONPATH=src python3 scripts/decode_variants_time.py [--shapes 1,8192 1,131072] [--pages 16]
"""

import argparse

import torch
from triton.testing import do_bench

import triflash
from triflash.bench.runner import as_cuda_graph
from triflash.kernels import decode_hopper, dispatch, launch


def caches(batch, ctx, hkv, d, page):
    """(k_cache, v_cache, block_table): contiguous, or pages of ``page`` keys in shuffled order."""
    if page is None:
        shape, table = (batch, ctx), None
    else:
        n = batch * ctx // page
        table = torch.randperm(n, device="cuda").view(batch, ctx // page).to(torch.int32)
        shape = (n, page)
    return (torch.randn(*shape, hkv, d, device="cuda", dtype=torch.float16),
            torch.randn(*shape, hkv, d, device="cuda", dtype=torch.float16), table)


def timed(fn):
    """(eager µs, graph µs) of ``fn``, medians (the graph captured as ``triflash bench`` does)."""
    eager = do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    replay, note = as_cuda_graph(fn, "cuda")
    if replay is fn:
        raise RuntimeError(note)
    return eager, do_bench(replay, warmup=25, rep=200, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["1,8192", "1,32768", "1,131072", "4,32768"])
    ap.add_argument("--pages", nargs="*", default=["none", "16"])
    a = ap.parse_args()
    hq, hkv, d = 32, 8, 128
    torch.manual_seed(0)
    slopes = torch.tensor([2 ** (-8 * (h + 1) / hq) for h in range(hq)], device="cuda")
    sinks = torch.randn(hq, device="cuda")
    variants = {"plain": {}, "sinks": dict(sinks=sinks), "softcap 30": dict(softcap=30.0),
                "alibi": dict(alibi_slopes=slopes), "window 12k": dict(window_size=(12288, 0)),
                "all + window 12k": dict(sinks=sinks, softcap=30.0, alibi_slopes=slopes, window_size=(12288, 0))}
    gluon_calls = []
    real = decode_hopper.decode_hopper
    decode_hopper.decode_hopper = lambda *args, **kw: gluon_calls.append(1) or real(*args, **kw)
    rows = []
    for page in [None if p == "none" else int(p) for p in a.pages]:
        for batch, ctx in [tuple(int(x) for x in s.split(",")) for s in a.shapes]:
            k_cache, v_cache, table = caches(batch, ctx, hkv, d, page)
            seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.float16)
            for name, kw in variants.items():
                outs, cells = [], []
                for on in (False, True):
                    dispatch.GLUON_DECODE_VARIANTS = on
                    launch.clear_plans()
                    gluon_calls.clear()

                    def call():
                        return triflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                                block_table=table, **kw)
                    outs.append(call())
                    kernel = "gluon" if gluon_calls else "triton"
                    cells.append((kernel, *timed(call)))
                diff = (outs[0].float() - outs[1].float()).abs().max().item()
                rows.append((batch, ctx, "contig" if page is None else f"page{page}", name, diff, *cells))
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", __import__("triton").__version__)
    print(f"{'B':>2} {'ctx':>6} {'cache':7} {'variant':17} {'max diff':>9} | {'off: kernel':11} {'eager':>7} "
          f"{'graph':>7} | {'on: kernel':11} {'eager':>7} {'graph':>7} | on/off graph")
    for b, ctx, cache, name, diff, off, on in rows:
        print(f"{b:>2} {ctx:>6} {cache:7} {name:17} {diff:9.2e} | {off[0]:11} {off[1]:7.1f} {off[2]:7.1f} | "
              f"{on[0]:11} {on[1]:7.1f} {on[2]:7.1f} | {on[2] / off[2]:.3f}")


if __name__ == "__main__":
    main()

"""Time a short list of decode configs side by side, in interleaved rounds, on the GPU.

Where ``tune_decode.py`` sweeps hundreds of tiles once each, this script takes a few named
candidates per shape and times every one of them ``--rounds`` times in round-robin order (SDPA's
backends in the same rounds), so that differences of a fraction of a percent are not the drift of
one moment. Each variant is checked against the fp32 reference before its first timing (the
benchmark's runner and tolerance rule: a wrong variant is never timed). The table printed last gives
the median over rounds, in µs per call and GB/s of K/V read, CUDA-graph replays as the bench times
decode. Hq=32, Hkv=8, D=128, fp16, one query token, page size 16 (pages shuffled).

    PYTHONPATH=src python3 scripts/gpu_decode_variants.py [--shapes 16,8192 ...] [--rounds 5]
        [--clean-l2] [--gluon] [--out $OUT/decode_variants.json]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_decode import (DTYPE, HEAD_DIM, HEADS, HEADS_KV, DecodeVariant, describe, parse_shape,  # noqa: E402
                         result_row)

from triflash.bench.checking import make_decode_case  # noqa: E402
from triflash.bench.decode import SdpaDecode  # noqa: E402
from triflash.bench.providers import Prepared  # noqa: E402
from triflash.bench.runner import DoBench, free_memory, load_error, run_one  # noqa: E402
from triflash.bench.workloads import decode_workloads  # noqa: E402
from triflash.kernels import configs, decode_hopper  # noqa: E402
from triflash.kernels.configs import DecodeConfig  # noqa: E402


# Cache kinds: "contiguous" [B, S, Hkv, D]; "paged" the bench's copy (page size 16, pages shuffled);
# "paged-ordered" the contiguous cache itself seen as pages, block table in page order (same kernel
# as "paged", same bytes, only the page placement differs).
KINDS = ("contiguous", "paged", "paged-ordered")


# The Gluon kernel's (block_n, ring depth) tiles timed with --gluon (decode_hopper.py).
GLUON_TILES = [(128, 2), (64, 2), (64, 3)]


def gluon_splits(batch: int, context: int, block_n: int, stages: int) -> int:
    """The split count decode_config's rule gives a Gluon tile: one wave of resident programs, two
    per SM where two fit in shared memory (``decode_hopper.programs_per_sm``)."""
    per_sm = decode_hopper.programs_per_sm(HEAD_DIM, block_n, stages)
    return configs.effective_splits(
        configs.decode_num_splits(programs=batch * HEADS_KV, max_seqlen=context, block_n=block_n,
                                  per_sm=per_sm, sms=132), context, block_n)


def candidates(batch: int, context: int, gluon: bool):
    """(cache kind, name, DecodeConfig or None for the launcher's own pick) per shape. Run 36 tried
    three to five K/V buffers per SM (N128 at 4 and 7 stages, N64 at 9 and 11, 4 or 8 warps) and an
    L2 prefetch of the block table: all level or slower than the auto picks (performance-notes).
    gluon: also the Gluon kernel's tiles, on the contiguous and the paged cache."""
    out = [(kind, "auto", None) for kind in KINDS]
    if gluon:
        for block_n, stages in GLUON_TILES:
            splits = gluon_splits(batch, context, block_n, stages)
            cfg = DecodeConfig(64, block_n, 4, stages, splits, kernel="gluon")
            name = f"gluon-N{block_n}-s{stages}-x{splits}"
            out += [("contiguous", name, cfg), ("paged", name, cfg)]
    elif batch * HEADS_KV <= 132:
        out += [("paged", "N128-w8-s5", DecodeConfig(16, 128, 8, 5)),
                ("paged-ordered", "N128-w8-s5", DecodeConfig(16, 128, 8, 5))]
    return out


class CleanL2:
    """A timer like do_bench's (its 256 MB flush before every call, CUDA events around the call)
    that then reads a second 256 MB buffer before the call, so the L2 holds clean lines only. The
    difference to do_bench is what writing back the flush's dirty lines costs inside the call."""

    def __init__(self, rep: int = 200):
        self.rep = rep
        self.flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
        self.clean = torch.ones(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
        self.sink = torch.empty((), dtype=torch.int64, device="cuda")

    def __call__(self, fn):
        for _ in range(5):
            fn()
        times = []
        for _ in range(self.rep):
            self.flush.zero_()
            self.sink.copy_(self.clean.sum())
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in times)
        return ms[len(ms) // 2], ms[len(ms) // 5], ms[(4 * len(ms)) // 5]


def ordered_pages(case, page_size: int = 16) -> tuple:
    """The contiguous cache viewed as [B * S / page_size, page_size, Hkv, D] pages, in order."""
    batch, s_alloc, heads_kv, head_dim = case.k_cache.shape
    pages = s_alloc // page_size
    table = torch.arange(batch * pages, dtype=torch.int32, device=case.k_cache.device).view(batch, pages)
    view = (lambda c: c.view(batch * pages, page_size, heads_kv, head_dim))
    return (case.q, view(case.k_cache), view(case.v_cache), case.cache_seqlens, table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", type=parse_shape,
                    default=[(16, 8192), (16, 32768), (16, 131072)])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=float, default=25)
    ap.add_argument("--rep", type=float, default=100)
    ap.add_argument("--out", default="decode_variants.json")
    ap.add_argument("--gluon", action="store_true",
                    help="time the Gluon kernel's tiles (GLUON_TILES) instead of run 36's extra configs")
    ap.add_argument("--clean-l2", action="store_true",
                    help="also time every variant behind a flush whose dirty lines were read out "
                         "of the L2 first (CleanL2), next to do_bench's flush")
    a = ap.parse_args(argv)
    device = torch.device("cuda")
    print(f"GPU {torch.cuda.get_device_name(device)} | torch {torch.__version__} | triton "
          f"{triton.__version__}", flush=True)
    timers = [("bench", DoBench(a.warmup, a.rep))] + ([("clean", CleanL2())] if a.clean_l2 else [])
    rows, table = [], []
    t0 = time.time()
    for batch, context in a.shapes:
        wl = decode_workloads(DTYPE, batch=batch, heads=HEADS, heads_kv=HEADS_KV, contexts=(context,),
                              head_dims=(HEAD_DIM,))[0]
        case = make_decode_case(wl, device)
        prepared = {kind: Prepared(case.args(paged=kind == "paged")) for kind in ("contiguous", "paged")}
        prepared["paged-ordered"] = Prepared(ordered_pages(case))
        providers = []
        for backend in ("cudnn", "flash"):
            sdpa = SdpaDecode(backend)
            if load_error(sdpa) is None:
                providers.append(("contiguous", sdpa.name, sdpa))
        providers += [(kind, name, DecodeVariant(name, prepared[kind], cfg, context))
                      for kind, name, cfg in candidates(batch, context, a.gluon)]
        entries = [(kind, name, prov, tname, timer) for kind, name, prov in providers
                   for tname, timer in timers]
        times = {i: [] for i in range(len(entries))}
        broken = set()
        for r in range(a.rounds):
            for i, (kind, name, prov, tname, timer) in enumerate(entries):
                if i in broken:
                    continue
                res = run_one(prov, case, timer, device)
                row = result_row(SimpleNamespace(batch=batch, context=context), kind, f"round{r}",
                                 name, res, timer=tname)
                rows.append(row)
                if row.get("status") != "ok" or row.get("us") is None:
                    broken.add(i)
                    print(f"  B{batch} {context} {kind:<10} {name:<26} {describe(row)}", flush=True)
                    continue
                times[i].append(row["us"])
        kv_bytes = 2 * batch * context * HEADS_KV * HEAD_DIM * 2
        for i, (kind, name, _, tname, _) in enumerate(entries):
            if times[i]:
                us = statistics.median(times[i])
                table.append((batch, context, kind, name, tname, us, kv_bytes / us / 1e3,
                              min(times[i]), max(times[i])))
        del case, prepared
        free_memory(device)
    Path(a.out).write_text(json.dumps(dict(rows=rows, table=table), indent=1))
    print(f"\n| batch | context | cache | variant | timer | µs (median of {a.rounds}) | GB/s | min-max µs |")
    print("|---|---|---|---|---|---|---|---|")
    for b, c, kind, name, tname, us, gbps, lo, hi in table:
        print(f"| {b} | {c} | {kind} | {name} | {tname} | {us:.1f} | {gbps:.0f} | {lo:.1f}-{hi:.1f} |")
    print(f"\n{time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Try decode-kernel configs on the GPU, contiguous and paged caches, beside SDPA, and print a table.

Used to fill the decode chooser (``decode_config`` / ``decode_num_splits`` in
src/triflash/kernels/configs.py). One query token per sequence, Hq=32, Hkv=8, D=128, fp16, every
sequence ``context`` keys long; the cache is contiguous [B, S, Hkv, D] or paged (page size 16, pages
shuffled in the block table, as ``triflash bench --mode decode`` builds it).

Per (shape, cache kind):

1. "auto": the launcher's own pick (config=None, num_splits=0);
2. tile sweep: every (block_n, num_warps, num_stages) at the launcher's own split count for the
   contiguous cache (rounded to whole key blocks of that tile) and at twice it;
3. split sweep: every split count of the shape's list for the ``--top`` best tiles of step 2.

Each variant goes through the benchmark's runner (``triflash.bench.runner.run_one``): one call checked
against the fp32 reference under the benchmark's tolerance rule (a wrong one is not timed), then the
median of triton.testing.do_bench over CUDA-graph replays of one call, as the bench times decode.
GB/s = K and V bytes read (2 * B * context * Hkv * D * 2 bytes) / median time. SDPA (the bench's
``SdpaDecode`` provider, contiguous [B, H, S, D] copy, enable_gqa) is timed per shape as the peer.

Compiles happen first, in parallel worker processes, on small inputs of the same layouts (they fill
Triton's on-disk cache), so the timing pass only loads binaries.

    PYTHONPATH=src python3 scripts/tune_decode.py --out $OUT/tune_decode.json [--shapes 16,8192 1,131072]
    PYTHONPATH=src python3 scripts/tune_decode.py --dry-run      # list the variants (no GPU needed)

Full results (every variant) go to --out as JSON; a Markdown summary is printed last on stdout;
progress goes to stderr. With the defaults: 60 precompile jobs (24 tiles x 2 layouts, and 12
merges) and at most about 780 timed variants; --budget (170 s) caps the timing pass.
"""

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import triton

from triflash.bench.checking import make_decode_case
from triflash.bench.decode import SdpaDecode
from triflash.bench.providers import Prepared, Provider
from triflash.bench.runner import DoBench, free_memory, load_error, run_one, stderr_progress
from triflash.bench.workloads import PAGE_SIZE, decode_workloads
from triflash.kernels import configs
from triflash.kernels.configs import DecodeConfig

HEADS, HEADS_KV, HEAD_DIM = 32, 8, 128
GROUP = HEADS // HEADS_KV                      # packed query rows per KV head (Sq = 1)
DTYPE = "fp16"
DEFAULT_SHAPES = ["16,8192", "16,32768", "16,131072", "1,131072", "64,8192"]
KINDS = ("contiguous", "paged")
BLOCK_NS, WARPS, STAGES = (32, 64, 128), (4, 8), (2, 3, 4, 5)   # paged needs 2 more than contiguous
TILES = list(itertools.product(BLOCK_NS, WARPS, STAGES))          # (block_n, num_warps, num_stages)
# Split counts: one long sequence needs many splits to fill 132 SMs (the launcher picks 64 at B=1,
# 128k); a batch of 16+ sequences x 8 KV heads already gives 128+ programs, so few.
FEW_SEQ_SPLITS = [16, 32, 48, 64, 66, 96, 128, 132, 192, 264]
MANY_SEQ_SPLITS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32]
FEW_SEQ_BATCH = 8                              # batches below this use FEW_SEQ_SPLITS
# Precompiles run on caches this long (every integer the kernels specialise on stays in the same
# class: multiples of 16), with the real batch sizes (the merge's tiles depend on the row count).
WARM_CONTEXT = 512
WARM_DEVICE = "cuda"


# --------------------------------------------------------------------------------------------------
# The plan: which variants each shape gets
# --------------------------------------------------------------------------------------------------

def cfg_name(cfg: DecodeConfig) -> str:
    return f"M{cfg.block_m}-N{cfg.block_n}-w{cfg.num_warps}-s{cfg.num_stages}-x{cfg.num_splits}"


def split_list(batch: int) -> list[int]:
    return FEW_SEQ_SPLITS if batch < FEW_SEQ_BATCH else MANY_SEQ_SPLITS


def fits(splits: int, context: int, block_n: int) -> bool:
    """At least DECODE_MIN_BLOCKS_PER_SPLIT (2) key blocks per split, as the chooser requires."""
    return splits == 1 or triton.cdiv(context, block_n) // splits >= configs.DECODE_MIN_BLOCKS_PER_SPLIT


@dataclass
class ShapePlan:
    batch: int
    context: int
    auto: DecodeConfig                      # what decode_config picks (config=None, num_splits=0)
    block_m: int                            # decode_config's block_m for GROUP rows, used everywhere
    auto_splits: dict = field(default_factory=dict)    # tile -> the launcher's split count, whole blocks
    phase1: list = field(default_factory=list)         # DecodeConfigs of the tile sweep
    phase2_splits: dict = field(default_factory=dict)  # tile -> split counts of the split sweep

    @property
    def label(self) -> str:
        return f"B={self.batch} ctx={self.context}"


def plan_shape(batch: int, context: int, device) -> ShapePlan:
    rows = GROUP * 1
    # The contiguous cache's pick labels the plan; each cache kind's own pick is timed as "auto".
    auto = configs.decode_config(head_dim=HEAD_DIM, dtype=torch.float16, rows=rows, batch=batch,
                                 heads_kv=HEADS_KV, max_seqlen=context, num_splits=0, paged=False,
                                 device=device)
    plan = ShapePlan(batch, context, auto, auto.block_m)
    for tile in TILES:
        bn = tile[0]
        a = configs.effective_splits(auto.num_splits, context, bn)
        plan.auto_splits[tile] = a
        for s in dict.fromkeys((a, 2 * a)):
            if s == a or fits(s, context, bn):
                plan.phase1.append(DecodeConfig(auto.block_m, *tile, num_splits=s))
        plan.phase2_splits[tile] = sorted(s for s in set(split_list(batch)) | {a, 2 * a}
                                          if s == a or fits(s, context, bn))
    return plan


# --------------------------------------------------------------------------------------------------
# Precompiling in worker processes
# --------------------------------------------------------------------------------------------------

def small_case(batch: int, device):
    wl = decode_workloads(DTYPE, batch=batch, heads=HEADS, heads_kv=HEADS_KV, contexts=(WARM_CONTEXT,),
                          head_dims=(HEAD_DIM,))[0]
    return make_decode_case(wl, device)


def decode_args(case, kind: str):
    """(q, k_cache, v_cache, cache_seqlens, block_table) of a case for one cache kind (paged: the
    bench's copy, page size 16, pages shuffled in the block table)."""
    return case.args(paged=kind == "paged")


def run_decode(args, config: DecodeConfig | None, max_seqlen: int):
    from triflash.kernels.decode import decode

    q, k_cache, v_cache, cache_seqlens, block_table = args
    return decode(q, k_cache, v_cache, cache_seqlens, block_table, seqlen_new=0, max_seqlen=max_seqlen,
                  sm_scale=HEAD_DIM ** -0.5, causal=False, num_splits=0, config=config)


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def warm_job(job):
    """Worker: launch what one job needs on small inputs (compiling into Triton's disk cache).
    Returns {failure key: message}; never raises. Only failures of the launches themselves are
    keyed ("tile" / "call", and the timing pass skips those variants); anything else (making the
    inputs, a broken worker) is keyed "job" and only reported."""
    dev = WARM_DEVICE
    try:
        if job[0] == "merge":
            _, batch, splits = job
            from triflash.kernels.merge import merge

            # Exactly the tensors decode() hands the merge (see kernels/decode.py).
            o_part = torch.zeros((splits, batch, 1, HEADS, HEAD_DIM), dtype=torch.float32, device=dev)
            l_part = torch.zeros((splits, batch, HEADS, 1), dtype=torch.float32, device=dev)
            out = torch.empty((batch, 1, HEADS, HEAD_DIM), dtype=torch.float16, device=dev)
            lse = torch.empty((batch, HEADS, 1), dtype=torch.float32, device=dev)
            merge(o_part, l_part, out=out, lse=lse)
            _sync(dev)
            return {}
        _, kind, tile, block_m, by_batch = job
        failures = {}
        for batch, splits in by_batch:
            args = decode_args(small_case(batch, dev), kind)
            for s in splits:
                try:
                    run_decode(args, DecodeConfig(block_m, *tile, num_splits=s), WARM_CONTEXT)
                    _sync(dev)
                except Exception as exc:  # noqa: BLE001 - reported per variant
                    failures[("call", kind, tile, batch, s)] = _error_text(exc)
                    # A tile that cannot compile (shared memory, ...) fails the same at every split:
                    # stop after a few instead of recompiling it for every one.
                    if len(failures) >= 3 or (batch, s) == (by_batch[0][0], by_batch[0][1][0]):
                        return {("tile", kind, tile): _error_text(exc)}
        return failures
    except Exception as exc:  # noqa: BLE001
        return {("job",) + tuple(str(x) for x in job[:3]): _error_text(exc)}


def warm_jobs(plans: list[ShapePlan], kinds, device):
    """(merge jobs, decode jobs): one decode job per (kind, tile) with every (batch, split) it may
    be timed at; one merge job per distinct merge kernel the split counts lead to."""
    by_tile = {}
    for plan in plans:
        for tile, splits in plan.phase2_splits.items():
            extra = [c.num_splits for c in plan.phase1 if (c.block_n, c.num_warps, c.num_stages) == tile]
            by_tile.setdefault(tile, {}).setdefault(plan.batch, set()).update(splits, extra)
    block_m = plans[0].block_m
    decode_jobs = [("decode", kind, tile, block_m, [(b, sorted(s)) for b, s in sorted(by_batch.items())])
                   for kind in kinds for tile, by_batch in by_tile.items()]
    merges = {}
    for tile, by_batch in by_tile.items():
        for batch, splits in by_batch.items():
            for s in splits:
                if s > 1:
                    rows = batch * HEADS
                    key = (configs.merge_config(block_d=configs.head_dim_block(HEAD_DIM), num_parts=s,
                                                num_rows=rows, device=device),
                           rows % 16 == 0, s % 16 == 0)
                    merges.setdefault(key, ("merge", batch, s))
    return list(merges.values()), decode_jobs


def precompile(plans, kinds, workers: int, timeout: float, device) -> dict:
    t0 = time.time()
    merge_jobs, decode_jobs = warm_jobs(plans, kinds, device)
    failures = {}
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        try:
            for jobs in (merge_jobs, decode_jobs):
                left = max(1.0, timeout - (time.time() - t0))
                for result in pool.map_async(warm_job, jobs, chunksize=1).get(timeout=left):
                    failures.update(result)
        except mp.TimeoutError:
            print(f"precompile stopped after {timeout:.0f}s (--compile-timeout); the rest compiles "
                  "on first use", flush=True)
    bad_tiles = sorted({k[1:] for k in failures if k[0] == "tile"})
    print(f"precompiled {len(merge_jobs)} merge + {len(decode_jobs)} decode jobs in "
          f"{time.time() - t0:.0f}s with {workers} workers; {len(failures)} failures"
          + (f" (tiles that fail: {', '.join(f'{k} N{t[0]}-w{t[1]}-s{t[2]}' for k, t in bad_tiles)})"
             if bad_tiles else ""), flush=True)
    for key, msg in failures.items():
        if key[0] == "job":
            print(f"  precompile job {key[1:]} failed: {msg}", flush=True)
    return failures


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------

class DecodeVariant(Provider):
    """The decode launcher with one explicit DecodeConfig (None: the launcher's own choice), on
    arguments prepared once per (shape, cache kind)."""

    def __init__(self, name: str, prepared: Prepared, config: DecodeConfig | None, max_seqlen: int):
        self.name, self.prepared, self.config, self.max_seqlen = name, prepared, config, max_seqlen
        self.description = f"triflash.kernels.decode.decode, config {name}"

    def prepare(self, case, requires_grad: bool = False) -> Prepared:
        return self.prepared

    def run(self, q, k_cache, v_cache, cache_seqlens, block_table):
        return run_decode((q, k_cache, v_cache, cache_seqlens, block_table), self.config,
                          self.max_seqlen)[0]


def result_row(plan: ShapePlan, kind: str, phase: str, name: str, result=None,
               config: DecodeConfig | None = None, **extra) -> dict:
    row = dict(batch=plan.batch, context=plan.context, kind=kind, phase=phase, name=name,
               config=asdict(config) if config else None)
    if result is not None:
        ms = result.ms
        row.update(status=result.status, detail=result.detail, max_err=result.max_err, tol=result.tol,
                   us=ms * 1e3 if ms else None, us_p20=result.ms_p20 * 1e3 if result.ms_p20 else None,
                   us_p80=result.ms_p80 * 1e3 if result.ms_p80 else None, gbps=result.gbps,
                   peak_mib=result.peak_mib)
    row.update(extra)
    return row


def ok(row) -> bool:
    return row.get("status") == "ok" and row.get("us") is not None


def describe(row) -> str:
    if ok(row):
        eager = " (eager!)" if "eagerly" in (row.get("detail") or "") else ""
        return f"{row['us']:9.1f} us {row['gbps']:6.0f} GB/s  err {row['max_err']:.1e}{eager}"
    return f"{row.get('status', '?').upper()}: {(row.get('detail') or '')[:150]}"


def sdpa_rows(plan, case, backends, timer, device, progress) -> list[dict]:
    rows = []
    for backend in backends:
        provider = SdpaDecode(backend)
        missing = load_error(provider)
        if missing:
            row = result_row(plan, "contiguous", "sdpa", provider.name, status="unavailable",
                             detail=missing)
        else:
            row = result_row(plan, "contiguous", "sdpa", provider.name,
                             run_one(provider, case, timer, device))
        progress(f"  [{plan.label} sdpa] {provider.name:<24} {describe(row)}")
        rows.append(row)
        free_memory(device)
    return rows


def tune_group(plan: ShapePlan, kind: str, case, args: tuple, timer, device, deadline: float,
               failures: dict, top: int, progress) -> list[dict]:
    """Every variant of one (shape, cache kind): auto, the tile sweep, the split sweep of the best."""
    prepared = Prepared(args)
    rows = []
    tag = f"[{plan.label} {kind}]"

    def time_variant(phase, config, name, force=False, **extra):
        tile = None if config is None else (config.block_n, config.num_warps, config.num_stages)
        known = (failures.get(("tile", kind, tile))
                 or failures.get(("call", kind, tile, plan.batch, config.num_splits))) if tile else None
        if known:
            row = result_row(plan, kind, phase, name, config=config, status="error",
                             detail=f"failed to compile or launch in the precompile pass: {known}")
        elif not force and time.time() > deadline:
            row = result_row(plan, kind, phase, name, config=config, status="skipped",
                             detail="time budget (--budget)")
        else:
            variant = DecodeVariant(name, prepared, config, plan.context)
            row = result_row(plan, kind, phase, name, run_one(variant, case, timer, device),
                             config=config, **extra)
        progress(f"  {tag} {phase:<6} {name:<22} {describe(row)}")
        rows.append(row)
        return row

    time_variant("auto", None, "auto", force=True, resolved=cfg_name(plan.auto))
    best_by_tile = {}
    for cfg in plan.phase1:
        row = time_variant("tiles", cfg, cfg_name(cfg))
        tile = (cfg.block_n, cfg.num_warps, cfg.num_stages)
        if ok(row) and row["us"] < best_by_tile.get(tile, float("inf")):
            best_by_tile[tile] = row["us"]
    done = {(c.block_n, c.num_warps, c.num_stages, c.num_splits) for c in plan.phase1}
    best_tiles = sorted(best_by_tile, key=best_by_tile.get)[:top]
    progress(f"  {tag} best tiles: " + ", ".join(f"N{t[0]}-w{t[1]}-s{t[2]} {best_by_tile[t]:.1f} us"
                                                   for t in best_tiles))
    for tile in best_tiles:
        for s in plan.phase2_splits[tile]:
            if (*tile, s) not in done:
                cfg = DecodeConfig(plan.block_m, *tile, num_splits=s)
                time_variant("splits", cfg, cfg_name(cfg))
    return rows


def run_shapes(plans: list[ShapePlan], kinds, sdpa_backends, timer, device, failures: dict, top: int,
               end_time: float, progress=stderr_progress) -> list[dict]:
    """Every shape: inputs and reference once, SDPA, then each cache kind. The time left is shared
    fairly: each (shape, kind) may start variants until its share of what remains is used."""
    rows = []
    groups_left = len(plans) * len(kinds)
    for i, plan in enumerate(plans, 1):
        progress(f"[{i}/{len(plans)}] {plan.label}: making inputs and reference "
                 f"(auto pick {cfg_name(plan.auto)})")
        wl = decode_workloads(DTYPE, batch=plan.batch, heads=HEADS, heads_kv=HEADS_KV,
                              contexts=(plan.context,), head_dims=(HEAD_DIM,))[0]
        case = make_decode_case(wl, device)
        rows += sdpa_rows(plan, case, sdpa_backends, timer, device, progress)
        for kind in kinds:
            deadline = time.time() + max(0.0, end_time - time.time()) / groups_left
            groups_left -= 1
            args = decode_args(case, kind)
            start = time.time()
            rows += tune_group(plan, kind, case, args, timer, device, deadline, failures, top, progress)
            progress(f"  [{plan.label} {kind}] done in {time.time() - start:.1f}s")
            del args
            free_memory(device)
        del case
        free_memory(device)
    return rows


# --------------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------------

def summary(rows: list[dict], plans: list[ShapePlan], kinds) -> str:
    lines = []
    table = ["| batch | context | cache | best variant | µs | GB/s | auto pick | µs | GB/s | best vs auto "
             "| SDPA | µs | GB/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for plan in plans:
        mine = [r for r in rows if (r["batch"], r["context"]) == (plan.batch, plan.context)]
        sdpa = sorted((r for r in mine if r["phase"] == "sdpa" and ok(r)), key=lambda r: r["us"])
        for kind in kinds:
            sel = [r for r in mine if r["kind"] == kind and r["phase"] != "sdpa"]
            tuned = sorted((r for r in sel if r["phase"] != "auto" and ok(r)), key=lambda r: r["us"])
            auto = next((r for r in sel if r["phase"] == "auto"), None)
            failed = [r for r in sel if r.get("status") not in ("ok", "skipped")]
            skipped = sum(r.get("status") == "skipped" for r in sel)
            lines.append(f"\n## {plan.label} {kind}: {len(tuned)} timed, {len(failed)} failed, "
                         f"{skipped} skipped")
            for r in ([auto] if auto else []) + tuned[:5]:
                name = f"auto = {r['resolved']}" if r["phase"] == "auto" else r["name"]
                lines.append(f"  {name:<30} {describe(r)}")
            for r in failed[:4]:
                lines.append(f"  FAIL {r['name']:<25} {describe(r)[:120]}")
            best = tuned[0] if tuned else None
            cells = [str(plan.batch), str(plan.context), kind]
            cells += [best["name"], f"{best['us']:.1f}", f"{best['gbps']:.0f}"] if best else ["-", "-", "-"]
            auto_ok = auto is not None and ok(auto)
            cells += [auto["resolved"] if auto else "-"]
            cells += [f"{auto['us']:.1f}", f"{auto['gbps']:.0f}"] if auto_ok else ["-", "-"]
            cells += [f"{auto['us'] / best['us']:.2f}x" if auto_ok and best else "-"]
            cells += ([sdpa[0]["name"], f"{sdpa[0]['us']:.1f}", f"{sdpa[0]['gbps']:.0f}"] if sdpa
                      else ["-", "-", "-"])
            table.append("| " + " | ".join(cells) + " |")
    lines.append("\n## Best per (shape, cache) vs the auto pick and SDPA (SDPA reads a contiguous copy)\n")
    return "\n".join(lines + table)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------

def parse_shape(text: str) -> tuple[int, int]:
    try:
        batch, context = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is batch,context (e.g. 16,8192), got {text!r}")
    if batch < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"batch and context must be positive, got {text!r}")
    return batch, context


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES],
                    metavar="B,CONTEXT", help=f"batch,context pairs (default: {' '.join(DEFAULT_SHAPES)})")
    ap.add_argument("--kinds", nargs="*", choices=KINDS, default=list(KINDS), help="cache layouts")
    ap.add_argument("--sdpa", nargs="*", default=["flash", "efficient", "cudnn"],
                    choices=["flash", "efficient", "cudnn", "math"], help="SDPA backends timed as peers")
    ap.add_argument("--top", type=int, default=3, help="tiles of the tile sweep given the split sweep")
    ap.add_argument("--out", default="tune_decode.json")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1),
                    help="precompile worker processes (0: compile on first use, in the timing pass)")
    ap.add_argument("--compile-timeout", type=float, default=120.0, metavar="S",
                    help="stop precompiling after this many seconds")
    ap.add_argument("--budget", type=float, default=170.0, metavar="S",
                    help="seconds from the start after which no more variants are timed (auto and SDPA "
                         "always are); shared fairly between the (shape, cache) groups")
    ap.add_argument("--warmup", type=float, default=10.0, metavar="MS", help="do_bench warmup")
    ap.add_argument("--rep", type=float, default=40.0, metavar="MS", help="do_bench repetition time")
    ap.add_argument("--dry-run", action="store_true",
                    help="list the variants and precompile jobs, run nothing (no GPU needed; without "
                         "one, the SM count is --sm-count)")
    ap.add_argument("--sm-count", type=int, default=132, help="SM count for --dry-run without a GPU (H200)")
    return ap


def dry_run(a) -> int:
    if torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        class FakeProps:  # what the choosers read, as an H200 reports it
            major, minor, multi_processor_count, name = 9, 0, a.sm_count, "H200 (assumed)"
        torch.cuda.get_device_properties = lambda *args, **kwargs: FakeProps()
        device = torch.device("cpu")
        print(f"no GPU: planning as for {a.sm_count} SMs (interpreter: {configs.INTERPRET})")
    plans = [plan_shape(b, c, device) for b, c in a.shapes]
    print(f"tiles ({len(TILES)}): " + ", ".join(f"N{t[0]}-w{t[1]}-s{t[2]}" for t in TILES))
    total_min = total_max = 0
    for plan in plans:
        p1 = len(plan.phase1)
        done = {(c.block_n, c.num_warps, c.num_stages, c.num_splits) for c in plan.phase1}
        p2 = sorted((sum((*t, s) not in done for s in plan.phase2_splits[t]) for t in TILES), reverse=True)
        p2_max = sum(p2[:a.top])
        print(f"{plan.label}: auto {cfg_name(plan.auto)}; auto splits by block_n "
              + str({t[0]: s for t, s in plan.auto_splits.items()})
              + f"; tile sweep {p1} variants; split sweep <= {p2_max} (splits "
              + ", ".join(f"N{t[0]}: {plan.phase2_splits[t]}" for t in TILES if t[1:] == (4, 2)) + ")")
        for cfg in plan.phase1:
            print(f"    tiles  {cfg_name(cfg)}")
        total_min += len(a.kinds) * (1 + p1)
        total_max += len(a.kinds) * (1 + p1 + p2_max)
    merge_jobs, decode_jobs = warm_jobs(plans, a.kinds, device)
    launches = sum(len(s) for job in decode_jobs for _, s in job[4])
    print(f"precompile: {len(merge_jobs)} merge jobs, {len(decode_jobs)} decode jobs "
          f"({launches} small launches)")
    print(f"timed triflash variants: {total_min} + split sweeps = at most {total_max}; "
          f"plus {len(a.sdpa)} SDPA backends x {len(plans)} shapes")
    return 0


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.dry_run:
        return dry_run(a)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time (try --dry-run)", file=sys.stderr)
        return 2
    t0 = time.time()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    print(f"GPU {torch.cuda.get_device_name(device)} ({props.multi_processor_count} SMs) | torch "
          f"{torch.__version__} (CUDA {torch.version.cuda}) | triton {triton.__version__}", flush=True)
    plans = [plan_shape(b, c, device) for b, c in a.shapes]
    failures = precompile(plans, a.kinds, a.workers, a.compile_timeout, device) if a.workers > 0 else {}
    rows = run_shapes(plans, a.kinds, a.sdpa, DoBench(a.warmup, a.rep), device, failures, a.top,
                      t0 + a.budget)
    meta = dict(gpu=torch.cuda.get_device_name(device), sm_count=props.multi_processor_count,
                torch=torch.__version__, cuda=torch.version.cuda, triton=triton.__version__,
                heads=HEADS, heads_kv=HEADS_KV, head_dim=HEAD_DIM, dtype=DTYPE, page_size=PAGE_SIZE,
                tiles=TILES, few_seq_splits=FEW_SEQ_SPLITS, many_seq_splits=MANY_SEQ_SPLITS,
                args={k: v for k, v in vars(a).items()}, seconds=time.time() - t0,
                auto={p.label: cfg_name(p.auto) for p in plans},
                precompile_failures={" ".join(map(str, k)): v for k, v in failures.items()},
                timing="median of triton.testing.do_bench over CUDA-graph replays of one call; "
                       "GB/s = 2 * B * context * Hkv * D * 2 bytes / median")
    with open(a.out, "w") as f:
        json.dump(dict(meta=meta, variants=rows), f, indent=1)
    print(summary(rows, plans, a.kinds))
    print(f"\nwrote {len(rows)} rows to {a.out}; total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile every variant of the Gluon Hopper forward (kernels/forward_hopper.py) for sm_90 on a machine
without a GPU, and report registers, spills, shared memory and SASS instruction counts per variant.

As in scripts/compile_check.py, the launcher runs on CPU tensors with the kernel swapped for a
recorder; the recorded arguments become a signature (with the tt.divisibility = 16 hints a real
launch would add) for ``triton.compile(GluonASTSource(...), target=GPUTarget("cuda", 90, 32))``.
Triton's whole pipeline and ptxas (bundled with the wheel) run; cuobjdump (also bundled) reads the
cubin. ptxas is run once more on the PTX with -v to surface its wgmma serialization warnings.

    PYTHONPATH=src python scripts/gluon_check.py [--variants pp pp_persist] [--ptx-dump DIR]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)

import compile_check  # noqa: E402  (scripts/ is on sys.path when run as a script)
import torch  # noqa: E402
import triton  # noqa: E402
from compile_check import Recorder  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor  # noqa: E402

from triflash.kernels import backward_hopper as BH  # noqa: E402
from triflash.kernels import decode_hopper as DH  # noqa: E402
from triflash.kernels import forward_hopper as FH  # noqa: E402
from triflash.kernels.common import PLAIN as PLAIN_SCORES  # noqa: E402
from triflash.kernels.common import ScoreVariant, Varlen  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)      # (backend, compute capability, warp size)
TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32"}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _gluon_descriptor(v):
    """A Gluon descriptor's signature type: its block shape and shared layout."""
    if isinstance(v, GluonTensorDescriptor):
        return f"tensordesc<{TYPES[v.base.dtype]}[{','.join(str(b) for b in v.block_shape)}],{v.layout!r}>"
    return None


def signature(fn, args, kwargs):
    """compile_check's signature (the hints a real launch adds), Gluon descriptors typed with their
    block shape and shared layout, and maxnreg passed on."""
    return compile_check.signature(fn, args, kwargs, descriptor=_gluon_descriptor,
                                   option_names=("num_warps", "num_stages", "maxnreg"))


def tool(name, *argv, data=None, suffix=".cubin"):
    with tempfile.NamedTemporaryFile(suffix=suffix, mode="wb") as f:
        f.write(data)
        f.flush()
        r = subprocess.run([os.path.join(BIN, name), *argv, f.name], capture_output=True, text=True)
        return r.stdout + r.stderr


def ptxas_warnings(ptx: str) -> list[str]:
    """ptxas -v on the PTX: wgmma serialization and spill lines (Triton's own ptxas call hides them)."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "-arch=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    lines = (r.stdout + r.stderr).splitlines()
    return [line.strip() for line in lines if any(w in line.lower() for w in ("wgmma", "spill", "error"))]


def compile_one(label, run, dump_dir=None, module=FH, kernel="_attn_fwd_hopper_kernel"):
    calls = []
    saved = getattr(module, kernel)
    setattr(module, kernel, Recorder(saved, calls))
    try:
        run()
    finally:
        setattr(module, kernel, saved)
    ok = True
    for fn, args, kwargs in calls:
        t0 = time.time()
        try:
            sig, const, attrs, options = signature(fn, args, kwargs)
            k = triton.compile(GluonASTSource(fn, sig, const, attrs), target=TARGET, options=options)
            usage = tool("cuobjdump", "--dump-resource-usage", data=k.asm["cubin"])
            regs = re.search(r"REG:(\d+)", usage)
            stack = re.search(r"STACK:(\d+)", usage)
            sass = tool("cuobjdump", "--dump-sass", data=k.asm["cubin"])
            ptx = k.asm["ptx"]
            setmax = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
            info = (f"regs {regs.group(1) if regs else '?':>3} stack {stack.group(1) if stack else '?':>4} "
                    f"smem {k.metadata.shared:6d} HGMMA {sass.count('HGMMA'):3d} STL {sass.count('STL'):3d} "
                    f"LDL {sass.count('LDL'):3d} BAR {len(re.findall(r'BAR.SYNC', sass)):2d} "
                    f"setmaxnreg {','.join(a + b for a, b in setmax)} ({time.time() - t0:.0f}s)")
            print(f"  ok   {label:<36} {info}", flush=True)
            for w in ptxas_warnings(ptx):
                print(f"       ptxas: {w[:200]}", flush=True)
            if dump_dir:
                os.makedirs(dump_dir, exist_ok=True)
                base = os.path.join(dump_dir, label.replace(" ", "_"))
                for ext in ("ttgir", "ptx"):
                    with open(f"{base}.{ext}", "w") as f:
                        f.write(k.asm[ext])
                with open(f"{base}.sass", "w") as f:
                    f.write(sass)
        except Exception as e:  # noqa: BLE001 - report and go on
            ok = False
            msg = [m for m in str(e).strip().splitlines() if m.strip()]
            err = next((m for m in msg if "error" in m.lower()), msg[-1] if msg else type(e).__name__)
            print(f"  FAIL {label:<36} {err[:300]}", flush=True)
            if os.environ.get("GLUON_CHECK_VERBOSE"):
                print("".join(traceback.format_exception(e))[-6000:])
    return ok


def cases(variants):
    for variant in variants:
        for d in sorted(FH.VARIANTS[variant]):
            for dtype in (torch.float16, torch.bfloat16):
                if dtype == torch.bfloat16 and FH.variant_config(variant, d)["ltc"]:
                    continue          # LTC variants take fp16 only (forward_hopper refuses bf16)
                for causal in (False, True):
                    q = torch.randn(2, 1000, 8, d, dtype=dtype)
                    k = torch.randn(2, 1500, 2, d, dtype=dtype)
                    v = torch.randn(2, 1500, 2, d, dtype=dtype)
                    # Causal persistent variants: each tile order of the persistent loop (the GPU
                    # tests force all three).
                    orders = tuple(FH.ORDERS) if causal and FH.variant_config(variant, d)["persistent"] \
                        else ("plain",)
                    for order in orders:
                        label = (f"{variant} D{d} {TYPES[dtype]} {'causal' if causal else 'full'}"
                                 + (f" {order}" if len(orders) > 1 else ""))
                        yield label, (lambda q=q, k=k, v=v, c=causal, var=variant, o=order:
                                      FH.forward_hopper(q, k, v, 0.1, c, variant=var, order=o))
                    # Local windows, as window_bounds passes them.
                    for window in WINDOWS[causal]:
                        label = f"{variant} D{d} {TYPES[dtype]} {'causal' if causal else 'full'} window{window}"
                        yield label, (lambda q=q, k=k, v=v, c=causal, var=variant, w=window:
                                      FH.forward_hopper(q, k, v, 0.1, c, variant=var, window=w))
                    # Packed sequences (an empty one among them; varlen forwards run only when forced
                    # until GPU-checked), alone, with a window and with every score variant.
                    qp, kp, vp = q[0, :917], k[0], v[0]
                    for name, window, scores in (("packed", None, PLAIN_SCORES),
                                                 ("packed window", WINDOWS[causal][0], PLAIN_SCORES),
                                                 ("packed softcap+alibi+sinks", None,
                                                  ScoreVariant(5.0, torch.rand(4, 8), torch.randn(8)))):
                        label = f"{variant} D{d} {TYPES[dtype]} {'causal' if causal else 'full'} {name}"
                        yield label, (lambda q=qp, k=kp, v=vp, c=causal, var=variant, w=window, sc=scores:
                                      FH.forward_hopper(q, k, v, 0.1, c, variant=var, window=w, scores=sc,
                                                        varlen=PACKED))
                    # The score variants (flags compiled in only when used): sinks alone (raw units, a
                    # sink folded at the end) and all three ([B, Hq] slopes; natural units), fp16.
                    if dtype == torch.float16:
                        every = ScoreVariant(5.0, torch.rand(2, 8), torch.randn(8))
                        for name, scores in (("sinks", ScoreVariant(0.0, None, torch.randn(8))),
                                             ("softcap+alibi+sinks", every)):
                            label = f"{variant} D{d} {TYPES[dtype]} {'causal' if causal else 'full'} {name}"
                            yield label, (lambda q=q, k=k, v=v, c=causal, var=variant, sc=scores:
                                          FH.forward_hopper(q, k, v, 0.1, c, variant=var, scores=sc))


def _backward_inputs(variants, want):
    """(label suffix, variant, q, k, v, do, stats, causal) for each variant, head dim and dtype where
    ``want(variant, head_dim)``: the shapes every backward compile case uses."""
    for variant in variants:
        for d in sorted(BH.VARIANTS[variant]):
            if not want(variant, d):
                continue
            for dtype in (torch.float16, torch.bfloat16):
                for causal in (False, True):
                    q = torch.randn(2, 1000, 8, d, dtype=dtype)
                    k = torch.randn(2, 1500, 2, d, dtype=dtype)
                    v = torch.randn(2, 1500, 2, d, dtype=dtype)
                    stats = torch.zeros(2, 8, BH.padded_rows(1000))
                    label = f"{variant} D{d} {TYPES[dtype]} {'causal' if causal else 'full'}"
                    yield label, variant, q, k, v, torch.randn_like(q), stats, causal


# Packed sequences of 300, 0, 17 and 600 queries over 500, 0, 100 and 400 keys.
PACKED = Varlen(torch.tensor([0, 300, 300, 317, 917], dtype=torch.int32),
                torch.tensor([0, 500, 500, 600, 1000], dtype=torch.int32), 600, 500)

# The windows the forward, dK/dV and dQ cases compile with (non-causal: both edges, a right edge only,
# a left edge only; causal: a left edge). -1: no bound on that side.
WINDOWS = {False: ((300, 77), (-1, 50), (100, -1)), True: ((300, 0),)}

# The backward's score variants, compiled at fp16: each alone ([Hq] slopes) and together ([B, Hq]).
BWD_SCORES = (("softcap", ScoreVariant(5.0)), ("alibi", ScoreVariant(0.0, torch.rand(8))),
              ("softcap+alibi", ScoreVariant(5.0, torch.rand(2, 8))))


def backward_cases(variants):
    for label, variant, q, k, v, do, stats, causal in _backward_inputs(variants, lambda var, d: True):
        yield f"bwd {label}", (lambda q=q, k=k, v=v, do=do, st=stats, c=causal, var=variant:
                               _backward_without_finish(do, q, k, v, st, c, var))
        for window in WINDOWS[causal] if not BH.computes_dq(variant) else ():
            yield f"bwd {label} window{window}", (lambda q=q, k=k, v=v, do=do, st=stats, c=causal, var=variant,
                                                  w=window: _backward_without_finish(do, q, k, v, st, c, var,
                                                                                     window=w))
        for name, scores in BWD_SCORES if q.dtype == torch.float16 else ():
            yield f"bwd {label} {name}", (lambda q=q, k=k, v=v, do=do, st=stats, c=causal, var=variant, sc=scores:
                                          _backward_without_finish(do, q, k, v, st, c, var, sc))
        if not BH.computes_dq(variant):
            for name, args in _packed_backward(q, k, v, do, causal):
                yield f"bwd {label} {name}", (lambda a=args, var=variant: BH.backward_hopper(
                    *a["tensors"], 0.1, a["causal"], None, torch.empty_like(a["tensors"][2]),
                    torch.empty_like(a["tensors"][3]), variant=var, **a["kw"]))


def dq_cases(variants):
    """The Gluon dQ kernel, for the variants and head dims that take it (backward_hopper.dq_on_gluon)."""
    def takes_it(variant, d):
        return not BH.computes_dq(variant) and BH.dq_on_gluon(variant, d)

    for label, variant, q, k, v, do, stats, causal in _backward_inputs(variants, takes_it):
        yield f"bwd-dq {label}", (lambda q=q, k=k, v=v, do=do, st=stats, c=causal, var=variant:
                                  BH.dq_hopper(do, q, k, v, st, st, 0.1, c, torch.empty_like(q), variant=var))
        for window in WINDOWS[causal]:
            yield f"bwd-dq {label} window{window}", (
                lambda q=q, k=k, v=v, do=do, st=stats, c=causal, var=variant, w=window:
                BH.dq_hopper(do, q, k, v, st, st, 0.1, c, torch.empty_like(q), variant=var, window=w))
        for name, scores in BWD_SCORES if q.dtype == torch.float16 else ():
            yield f"bwd-dq {label} {name}", (
                lambda q=q, k=k, v=v, do=do, st=stats, c=causal, var=variant, sc=scores:
                BH.dq_hopper(do, q, k, v, st, st, 0.1, c, torch.empty_like(q), variant=var, scores=sc))
        for name, args in _packed_backward(q, k, v, do, causal):
            yield f"bwd-dq {label} {name}", (lambda a=args, var=variant: BH.dq_hopper(
                *a["tensors"], 0.1, a["causal"], torch.empty_like(a["tensors"][1]), variant=var, **a["kw"]))


def _packed_backward(q, k, v, do, causal):
    """(name, arguments) of the packed-sequence cases of the dK/dV-only kernel and the dQ kernel: the
    forward's ``PACKED`` layout alone, with a window, and with softcap and [B, Hq] ALiBi (fp16)."""
    qp, kp, vp, dop = q[0, :917], k[0], v[0], do[0, :917]
    stats = torch.zeros(1, q.shape[2], BH.padded_rows(917, packed=True))
    tensors = (dop, qp, kp, vp, stats, stats)
    cases = [("packed", {}), ("packed window", dict(window=WINDOWS[causal][0]))]
    if q.dtype == torch.float16:
        cases.append(("packed softcap+alibi", dict(scores=ScoreVariant(5.0, torch.rand(4, q.shape[2])))))
    for name, kw in cases:
        yield name, dict(tensors=tensors, causal=causal, kw=dict(kw, varlen=PACKED))


def decode_cases(tiles):
    """The Gluon decode kernel (decode_hopper.py): each (block_n, stages) tile at head_dim 64 and
    128, fp16 and bf16, over a contiguous cache and paged caches of 16 and 256 keys per page; then
    with a window and the score variants (fp16, paged)."""
    yield from _decode_plain_cases(tiles)
    yield from _decode_variant_cases(tiles)


def _decode_variant_cases(tiles):
    """A local window (causal, left 300), softcap + ALiBi + sinks with one split (the sink in the
    kernel), ALiBi alone with three (raw units; the merge adds sinks then), and all of them."""
    batch, sq, hq, hkv, page = 2, 4, 32, 8, 16
    slopes = torch.rand(batch, hq)
    sinks = torch.randn(hq)
    every = ScoreVariant(5.0, slopes, sinks)
    kinds = (("window", (300, 0), PLAIN_SCORES, 3), ("softcap+alibi+sinks", None, every, 1),
             ("alibi", None, ScoreVariant(0.0, slopes), 3), ("window+all", (300, 0), every, 1))
    for block_n, stages in tiles:
        for d in (64, 128):
            for name, window, scores, splits in kinds:
                q = torch.randn(batch, sq, hq, d, dtype=torch.float16)
                k = torch.randn(2048 // page, page, hkv, d, dtype=torch.float16)
                v = torch.randn_like(k)
                table = torch.arange(2048 // page, dtype=torch.int32).view(batch, -1)
                seqlens = torch.full((batch,), 1000, dtype=torch.int32)
                o = torch.empty(splits, batch, sq, hq, d)
                lse = torch.empty(splits, batch, hq, sq)
                label = f"decode N{block_n} s{stages} D{d} fp16 page16 {name}"
                yield label, (lambda q=q, k=k, v=v, o=o, lse=lse, sl=seqlens, t=table, bn=block_n, st=stages, n=splits,
                              w=window, sc=scores:
                              DH.decode_hopper(q, k, v, o, lse, sl, t, 0, 0.1, w is not None, block_n=bn, stages=st,
                                               num_splits=n, window=w, scores=sc))


def _decode_plain_cases(tiles):
    for block_n, stages in tiles:
        for d in (64, 128):
            for dtype in (torch.float16, torch.bfloat16):
                for cache, page in (("contiguous", None), ("page16", 16), ("page256", 256)):
                    for causal in ((False, True) if cache == "page16" else (False,)):
                        batch, sq, hq, hkv = 2, 4 if causal else 1, 32, 8
                        q = torch.randn(batch, sq, hq, d, dtype=dtype)
                        if page is None:
                            k = torch.randn(batch, 1024, hkv, d, dtype=dtype)
                            table = None
                        else:
                            k = torch.randn(2048 // page, page, hkv, d, dtype=dtype)
                            table = torch.arange(2048 // page, dtype=torch.int32).view(batch, -1)
                        v = torch.randn_like(k)
                        seqlens = torch.full((batch,), 1000, dtype=torch.int32)
                        splits = 3
                        o = torch.empty(splits, batch, sq, hq, d)
                        lse = torch.empty(splits, batch, hq, sq)
                        label = (f"decode N{block_n} s{stages} D{d} {TYPES[dtype]} {cache}"
                                 + (" causal" if causal else ""))
                        yield label, (lambda q=q, k=k, v=v, o=o, lse=lse, sl=seqlens, t=table, c=causal,
                                      bn=block_n, st=stages, n=splits:
                                      DH.decode_hopper(q, k, v, o, lse, sl, t, 0, 0.1, c, block_n=bn,
                                                       stages=st, num_splits=n))


def _backward_without_finish(do, q, k, v, stats, causal, variant, scores=PLAIN_SCORES, window=None):
    """backward_hopper with its small Triton epilogue kernel not launched (no GPU here)."""
    saved = BH._dq_finish_kernel
    BH._dq_finish_kernel = Recorder(saved, [])
    try:
        BH.backward_hopper(do, q, k, v, stats, stats, 0.1, causal, torch.empty_like(q), torch.empty_like(k),
                           torch.empty_like(v), variant=variant, scores=scores, window=window)
    finally:
        BH._dq_finish_kernel = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="*", default=list(FH.VARIANTS))
    ap.add_argument("--backward", nargs="*", default=None,
                    help="compile these variants of the Gluon backward (backward_hopper.py), and the Gluon "
                         "dQ kernel where they take it, instead")
    ap.add_argument("--decode", nargs="*", default=None, metavar="N,STAGES",
                    help="compile the Gluon decode kernel (decode_hopper.py) at these tiles instead "
                         "(default 128,2 64,2 64,3 64,4)")
    ap.add_argument("--ptx-dump", default=None, help="write ttgir/ptx/sass per case here")
    a = ap.parse_args()
    if a.decode is not None:
        tiles = [tuple(int(x) for x in t.split(",")) for t in (a.decode or ["128,2", "64,2", "64,3", "64,4"])]
        ok = True
        for label, run in decode_cases(tiles):
            ok &= compile_one(label, run, a.ptx_dump, DH, "_decode_hopper_kernel")
        print("all compiled" if ok else "SOME FAILED")
        return 0 if ok else 1
    if a.backward is not None:
        ok = True
        for label, run in backward_cases(a.backward or list(BH.VARIANTS)):
            ok &= compile_one(label, run, a.ptx_dump, BH, "_attn_bwd_hopper_kernel")
        for label, run in dq_cases(a.backward or list(BH.VARIANTS)):
            ok &= compile_one(label, run, a.ptx_dump, BH, "_attn_bwd_dq_hopper_kernel")
        print("all compiled" if ok else "SOME FAILED")
        return 0 if ok else 1
    print(f"triton {triton.__version__}; target {TARGET}")
    for v in a.variants:
        for d in sorted(FH.VARIANTS[v]):
            print(f"  variant {v} D{d}: {FH.variant_config(v, d)}")
    ok = True
    for label, run in cases(a.variants):
        ok &= compile_one(label, run, a.ptx_dump)
    print("all compiled" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

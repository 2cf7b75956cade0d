"""Compile every kernel variant the launchers produce for sm_90 (Hopper) on a machine without a GPU.

The launchers are run on CPU tensors with each @triton.jit kernel swapped for a recorder; the recorded
arguments become a signature for ``triton.compile(..., target=GPUTarget("cuda", 90, 32))``, which runs
Triton's whole pipeline and ptxas (bundled with the triton wheel). This catches code-generation
errors the interpreter cannot see, and reports registers, spills and shared memory per variant; with
--sass it also counts HGMMA (Hopper tensor-core) instructions in the disassembly.

    PYTHONPATH=src python scripts/compile_check.py [--sass] [--only forward|backward|varlen|window|long|decode|merge]
        [--sass-dump DIR]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from triflash.kernels import backward as B  # noqa: E402
from triflash.kernels import configs  # noqa: E402
from triflash.kernels import dispatch  # noqa: E402
from triflash.kernels import decode as DEC  # noqa: E402
from triflash.kernels import forward as F  # noqa: E402
from triflash.kernels import merge as M  # noqa: E402
from triflash.kernels.common import Varlen  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


class _H200:
    """What the config choosers read from the device, as an H200 reports it."""
    multi_processor_count = 132
    major, minor = 9, 0


# The choosers ask the (absent) GPU for its properties: answer as an H200 would.
torch.cuda.get_device_properties = lambda *args, **kwargs: _H200()
torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64", torch.int32: "i32",
         torch.int64: "i64", torch.int8: "i8"}


class Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kwargs)`` records instead of launching."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


DIVISIBLE = [["tt.divisibility", 16]]


def signature(fn, args, kwargs):
    """The signature, constants, attributes and options Triton's launcher would compile these
    arguments with. Like a real launch (JITFunction.run), an int argument equal to 1 becomes a
    constant and one divisible by 16 (or a pointer aligned to 16 bytes) carries tt.divisibility = 16,
    unless the parameter is in do_not_specialize. Without those hints the compiler cannot prove
    16-byte alignment, loads fall back to scalars, and the register and spill figures are wrong."""
    sig, const, attrs = {}, {}, {}
    values = dict(zip(fn.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    for index, name in enumerate(fn.arg_names):
        v = values[name]
        param = fn.params[index]
        if param.is_constexpr or v is None:
            sig[name] = "constexpr"
            const[name] = v
        elif isinstance(v, TensorDescriptor):
            sig[name] = f"tensordesc<{TYPES[v.base.dtype]}[{','.join(str(b) for b in v.block_shape)}]>"
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + TYPES[v.dtype]
            if not param.do_not_specialize_on_alignment and v.data_ptr() % 16 == 0:
                attrs[(index,)] = DIVISIBLE
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1 and not param.do_not_specialize:
                sig[name] = "constexpr"
                const[name] = 1
                continue
            sig[name] = "i64" if abs(v) >= 2**31 else "i32"
            if not param.do_not_specialize and v % 16 == 0:
                attrs[(index,)] = DIVISIBLE
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot type {type(v)}")
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return sig, const, attrs, options


def compile_calls(label, run, sass, dump_dir=None):
    """Run ``run()`` with every kernel module's kernels replaced by recorders; compile what they record.
    ``dump_dir``: also write each kernel's SASS there (one file per label and kernel), for comparing
    two versions of the source byte for byte."""
    calls = []
    saved = []
    for mod in (F, B, DEC, M):
        for name in dir(mod):
            obj = getattr(mod, name)
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                saved.append((mod, name, obj))
                setattr(mod, name, Recorder(obj, calls))
    try:
        run()
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)
    ok = True
    calls_seen = []
    for fn, args, kwargs in calls:
        sig, const, attrs, options = signature(fn, args, kwargs)
        try:
            k = triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET, options=options)
            usage = cuobjdump(k.asm["cubin"], "--dump-resource-usage")
            regs = re.search(r"REG:(\d+)", usage)
            # ptxas puts register spills in the per-thread stack frame (STACK), not in LOCAL.
            stack = re.search(r"STACK:(\d+)", usage)
            info = (f"regs {regs.group(1) if regs else '?':>3} stack(spills) bytes "
                    f"{stack.group(1) if stack else '?':>5} smem {k.metadata.shared:6d}")
            if sass:
                dump = cuobjdump(k.asm['cubin'], '--dump-sass')
                info += f" HGMMA {dump.count('HGMMA'):4d} STL {dump.count('STL'):5d}"
            if dump_dir:
                name = re.sub(r"[^A-Za-z0-9]+", "_", f"{label} {fn.__name__} {len(calls_seen)}")
                calls_seen.append(name)
                with open(os.path.join(dump_dir, name + ".sass"), "w") as f:
                    f.write(cuobjdump(k.asm["cubin"], "--dump-sass"))
                # The PTX too: where two SASS dumps differ, equal PTX says ptxas scheduled the same
                # input differently (debug-scope labels of inlined helpers can change its register assignment).
                with open(os.path.join(dump_dir, name + ".ptx"), "w") as f:
                    f.write(k.asm["ptx"])
            print(f"  ok   {label:<44} {fn.__name__:<24} {info}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            ok = False
            msg = str(e).strip().splitlines()
            msg = next((m for m in msg if "error" in m.lower()), msg[-1] if msg else type(e).__name__)
            print(f"  FAIL {label:<44} {fn.__name__:<24} {msg[:160]}", flush=True)
    return ok


def cuobjdump(cubin: bytes, flag: str) -> str:
    """Run the cuobjdump that ships with the triton wheel on a cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def qkv(b, sq, sk, hq, hkv, d, dtype):
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype),
            torch.randn(b, sk, hkv, d, dtype=dtype))


def forward_cases():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for d in (64, 128, 40, 256):
            for causal in (False, True):
                q, k, v = qkv(2, 300, 300, 4, 2, d, dtype)
                # What the chooser picks on an H200 (132 SMs), for a long and a short problem.
                for sq in (4096, 512):
                    cfg = choose_forward(d, dtype, causal, 2 * 4, sq)
                    yield f"fwd {TYPES[dtype]} D{d} {'causal' if causal else 'full'} S{sq} {cfg.tma}", \
                        (lambda q=q, k=k, v=v, cfg=cfg, causal=causal: dispatch.forward(q, k, v, 0.1, causal, config=cfg))


def varlen_cases():
    """Packed sequences (flash_attn_varlen_func): the forward and backward Triton kernels with
    VARLEN, at the tiles the H200 would pick."""
    lengths = torch.tensor([0, 300, 17, 1000], dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    vl = Varlen(cu, cu, 1000, 1000)
    total = int(cu[-1])
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for d in (64, 128, 256):
            for causal in (False, True):
                q, k, v = (torch.randn(total, h, d, dtype=dtype) for h in (4, 2, 2))
                cfg = choose_forward(d, dtype, causal, 4 * 4, 1000)
                bcfg = configs.backward_config(head_dim=d, dtype=dtype, device="cuda")
                lse = torch.randn(4, total)
                yield f"varlen {TYPES[dtype]} D{d} {'causal' if causal else 'full'}", \
                    (lambda q=q, k=k, v=v, cfg=cfg, bcfg=bcfg, lse=lse, causal=causal:
                     (dispatch.forward(q, k, v, 0.1, causal, config=cfg, varlen=vl),
                      dispatch.backward(torch.randn_like(q), q, k, v, torch.randn_like(q), lse, 0.1, causal,
                                 config=bcfg, varlen=vl)))


def window_cases():
    """Local windows (window_size): the forward's and backward's three-range loops, on the tiles and
    tile movement (TMA descriptors on Hopper) the choosers pick."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for d in (64, 128):
            for causal, window in ((True, (256, 0)), (False, (100, 37)), (False, (-1, 5))):
                q, k, v = qkv(2, 300, 300, 4, 2, d, dtype)
                cfg = choose_forward(d, dtype, causal, 2 * 4, 4096)
                bcfg = configs.backward_config(head_dim=d, dtype=dtype, device="cuda")

                def run(q=q, k=k, v=v, cfg=cfg, bcfg=bcfg, causal=causal, window=window):
                    out, lse = dispatch.forward(q, k, v, 0.1, causal, config=cfg, window=window)
                    dispatch.backward(torch.randn_like(q), q, k, v, out, torch.randn(2, 4, 300), 0.1, causal,
                               config=bcfg, window=window)
                yield f"window{window} {TYPES[dtype]} D{d} {'causal' if causal else 'full'}", run
        if dtype != torch.bfloat16:
            cache = torch.randn(4, 1024, 2, 128, dtype=dtype)
            for splits in (1, 4):
                cfg = configs.DecodeConfig(block_m=16, block_n=32, num_warps=4, num_stages=2, num_splits=splits)

                def run_decode(cache=cache, cfg=cfg, dtype=dtype):
                    dispatch.decode(torch.randn(4, 3, 8, 128, dtype=dtype), cache, cache,
                               torch.full((4,), 200, dtype=torch.int32), None, 0, 200, 0.1, True, config=cfg,
                               window=(64, 0))
                yield f"window decode {TYPES[dtype]} splits{splits}", run_decode


def long_cases():
    """The kernels with 64-bit row offsets (LONG, taken when row * row stride can pass 2^31 - 1):
    forced here on small tensors (the flag, not the sizes, decides the code), including a row stride
    of 1 (one head of head_dim 1), which Triton passes as a constant."""
    import contextlib
    from unittest import mock

    from triflash.kernels import common

    @contextlib.contextmanager
    def forced():
        with mock.patch.object(F, "needs_int64_rows", lambda *t: True), \
                mock.patch.object(B, "needs_int64_rows", lambda *t: True), \
                mock.patch.object(DEC, "needs_int64_rows", lambda *t: True):
            yield
    for dtype in (torch.float16, torch.float32):
        for d, heads in ((64, (4, 2)), (128, (4, 2)), (1, (1, 1))):
            for causal in (False, True):
                q, k, v = qkv(2, 300, 300, heads[0], heads[1], d, dtype)
                cfg = configs.FwdConfig(64, 64, 4, 2, tma="none")
                bcfg = configs.backward_config(head_dim=d, dtype=dtype, device="cpu")

                def run(q=q, k=k, v=v, cfg=cfg, bcfg=bcfg, causal=causal):
                    with forced():
                        out, lse = dispatch.forward(q, k, v, 0.1, causal, config=cfg)
                        dispatch.backward(torch.randn_like(q), q, k, v, out, torch.randn(2, q.shape[2], 300), 0.1,
                                   causal, config=bcfg)
                yield f"long {TYPES[dtype]} D{d} {'causal' if causal else 'full'}", run
        cache = torch.randn(4, 1024, 2, 128, dtype=dtype)
        for splits in (1, 4):
            cfg = configs.DecodeConfig(block_m=16, block_n=32, num_warps=4, num_stages=2, num_splits=splits)

            def run_decode(cache=cache, cfg=cfg, dtype=dtype):
                with forced():
                    dispatch.decode(torch.randn(4, 3, 8, 128, dtype=dtype), cache, cache,
                               torch.full((4,), 200, dtype=torch.int32), None, 0, 200, 0.1, True, config=cfg)
            yield f"long decode {TYPES[dtype]} splits{splits}", run_decode
    assert common.needs_int64_rows(torch.empty(1, 2**19 + 1, 32, 128, device="meta"))


def choose_forward(d, dtype, causal, bh, sq):
    return configs.forward_config(head_dim=d, dtype=dtype, causal=causal, batch_heads=bh, seqlen_q=sq,
                                  device="cuda")


def backward_cases():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for d in (64, 128, 256):
            for causal in (False, True):
                q, k, v = qkv(2, 300, 300, 4, 2, d, dtype)
                out = torch.randn_like(q)
                lse = torch.randn(2, 4, 300)
                cfg = configs.backward_config(head_dim=d, dtype=dtype, device="cuda")
                yield f"bwd {TYPES[dtype]} D{d} {'causal' if causal else 'full'}", \
                    (lambda q=q, k=k, v=v, out=out, lse=lse, causal=causal, cfg=cfg:
                     dispatch.backward(torch.randn_like(q), q, k, v, out, lse, 0.1, causal, config=cfg))


def decode_cases():
    for dtype in (torch.float16, torch.float32):
        for paged, page in ((False, 1), (True, 16), (True, 256), (True, 5)):
            q = torch.randn(4, 1, 32, 128, dtype=dtype)
            cache = torch.randn(64 if paged else 4, page if paged else 1024, 8, 128, dtype=dtype)
            table = torch.arange(64, dtype=torch.int32).view(4, 16) if paged else None
            seqlens = torch.full((4,), 200, dtype=torch.int32)
            kind = 'page' + str(page) if paged else 'contig'
            for splits in (1, 8):
                cfg = configs.DecodeConfig(block_m=16,
                                           block_n=64 if dtype != torch.float32 else 32,
                                           num_warps=4, num_stages=3 if dtype != torch.float32 else 2,
                                           num_splits=splits)
                yield f"decode {TYPES[dtype]} {kind} splits{splits}", \
                    (lambda q=q, c=cache, t=table, s=seqlens, cfg=cfg:
                     dispatch.decode(q, c, c, s, t, 0, 200, 0.1, False, config=cfg))
            # What the chooser picks on an H200 for one long sequence and for a batch of 16.
            for batch in (1, 16):
                yield f"decode {TYPES[dtype]} {kind} auto B{batch}", \
                    (lambda q=q, c=cache, t=table, s=seqlens, b=batch:
                     dispatch.decode(q[:1].expand(b, -1, -1, -1), c, c, s[:1].expand(b), t[:1].expand(b, -1) if t is not None else None,
                                0, 8192, 0.1, False))


def merge_cases():
    for d in (16, 32, 64, 128, 256):
        for parts in (2, 8, 150):
            for rows in (4, 32768):                     # one decode step; a long prefill's merge
                o = torch.empty(parts, 1, rows // 4, 4, d)
                lse = torch.empty(parts, 1, 4, rows // 4)
                yield f"merge D{d} parts{parts} rows{rows}", (lambda o=o, lse=lse: M.merge(o, lse))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--only", choices=["forward", "backward", "varlen", "window", "long", "decode", "merge"])
    ap.add_argument("--sass-dump", metavar="DIR", help="write every kernel's SASS into DIR")
    a = ap.parse_args()
    if a.sass_dump:
        os.makedirs(a.sass_dump, exist_ok=True)
    groups = {"forward": forward_cases, "backward": backward_cases, "varlen": varlen_cases, "window": window_cases,
              "long": long_cases,
              "decode": decode_cases, "merge": merge_cases}
    ok = True
    for name, cases in groups.items():
        if a.only and a.only != name:
            continue
        print(f"== {name}")
        for label, run in cases():
            ok &= compile_calls(label, run, a.sass, a.sass_dump)
    print("all compiled" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

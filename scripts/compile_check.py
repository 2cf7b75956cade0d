"""Compile every kernel variant the launchers produce, for every GPU target Triton supports, on a
machine without a GPU.

The launchers are run on CPU tensors with each @triton.jit kernel swapped for a recorder, while
``torch.cuda.get_device_properties`` answers as the target GPU would (capability, multiprocessor count,
shared memory a block may opt in to), so the config choosers pick what they would pick on that GPU.
The recorded arguments become a signature for ``triton.compile(..., target=GPUTarget(...))``, which
runs Triton's whole pipeline and the assembler bundled with the triton wheel (ptxas for sm_80-90,
ptxas-blackwell for sm_100/120; AMD's hsaco linker for gfx9). A kernel FAILs when it does not compile,
when its shared memory (the compiled kernel's ``metadata.shared``, what Triton checks at launch)
exceeds what the target allows a block, or when its registers times its threads exceed the 64K
registers a block may hold. Reports registers, spills and shared memory per variant; with --sass it
also counts HGMMA (Hopper tensor-core) instructions in the disassembly.

    PYTHONPATH=src python scripts/compile_check.py [--arch 80,86,89,90,100,120,gfx942,gfx90a | all]
        [--quick] [--jobs N] [--sass] [--only forward|backward|varlen|window|long|decode|variants|merge]
        [--sass-dump DIR]

--quick compiles only what the choosers pick (one dtype of fp16/bf16, fp32, no forced configs): the CI
subset (about 65-80 s per target on one core with a cold Triton cache). Without --arch every NVIDIA
target is compiled; ``all`` adds AMD gfx942 and gfx90a, where parts of the portable kernels do not
compile yet with Triton 3.6 (libdevice's *_rn functions are CUDA-only; gfx90a rejects
input_precision="tf32" even for 16-bit dots).
"""

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from triflash.kernels import backward as B  # noqa: E402
from triflash.kernels import configs, dispatch  # noqa: E402
from triflash.kernels import decode as DEC  # noqa: E402
from triflash.kernels import forward as F  # noqa: E402
from triflash.kernels import merge as M  # noqa: E402
from triflash.kernels.common import ScoreVariant, Varlen  # noqa: E402


@dataclass(frozen=True)
class FakeProps:
    """What the config choosers read from the device (torch.cuda.get_device_properties), as the
    target's GPU reports it. shared_memory_per_block_optin: cudaDevAttrMaxSharedMemoryPerBlockOptin
    (hipDeviceAttributeMaxSharedMemoryPerBlock on ROCm), the limit Triton checks at launch."""
    name: str
    major: int
    minor: int
    multi_processor_count: int
    shared_memory_per_block_optin: int
    gcnArchName: str = ""


@dataclass(frozen=True)
class Target:
    key: str
    gpu: GPUTarget
    props: FakeProps

    @property
    def hip(self) -> bool:
        return self.gpu.backend == "hip"


# One GPU per target (the multiprocessor count only moves the short-problem rules). Shared memory per
# block (opt-in), from NVIDIA's tuning guides / CUDA occupancy tables and AMD's CDNA specs.
TARGETS = {t.key: t for t in (
    Target("80", GPUTarget("cuda", 80, 32), FakeProps("NVIDIA A100-SXM4-80GB", 8, 0, 108, 166912)),
    Target("86", GPUTarget("cuda", 86, 32), FakeProps("NVIDIA A40 / RTX 3090 / A10", 8, 6, 84, 101376)),
    Target("89", GPUTarget("cuda", 89, 32), FakeProps("NVIDIA RTX 4090 / L4 / L40S", 8, 9, 128, 101376)),
    Target("90", GPUTarget("cuda", 90, 32), FakeProps("NVIDIA H200", 9, 0, 132, 232448)),
    Target("100", GPUTarget("cuda", 100, 32), FakeProps("NVIDIA B200", 10, 0, 148, 232448)),
    Target("120", GPUTarget("cuda", 120, 32), FakeProps("NVIDIA RTX 5090", 12, 0, 170, 101376)),
    # ROCm's torch reports gfx942 as capability (9, 4) and gfx90a as (9, 0), Hopper's: the choosers
    # must tell them apart by torch.version.hip, not by the major version.
    Target("gfx942", GPUTarget("hip", "gfx942", 64),
           FakeProps("AMD Instinct MI300X", 9, 4, 304, 65536, gcnArchName="gfx942:sramecc+:xnack-")),
    Target("gfx90a", GPUTarget("hip", "gfx90a", 64),
           FakeProps("AMD Instinct MI250X", 9, 0, 110, 65536, gcnArchName="gfx90a:sramecc+:xnack-")),
)}
NVIDIA = [key for key, t in TARGETS.items() if not t.hip]
# The target the choosers see when this module is imported (what the script compiled before targets).
DEFAULT_TARGET = "90"

TARGET = TARGETS[DEFAULT_TARGET]


def use_target(target: Target):
    """Make the choosers see ``target``'s GPU: patch torch's device queries and torch.version.hip,
    and drop configs' per-device cache."""
    global TARGET
    TARGET = target
    torch.cuda.get_device_properties = lambda *args, **kwargs: target.props
    torch.cuda.get_device_capability = lambda *args, **kwargs: (target.props.major, target.props.minor)
    torch.version.hip = "6.4.0" if target.hip else None
    configs.clear_device_cache()


use_target(TARGET)


TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
         torch.int32: "i32", torch.int64: "i64", torch.int8: "i8"}


class Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kwargs)`` records instead of launching."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


DIVISIBLE = [["tt.divisibility", 16]]


def _host_descriptor(v):
    """The signature type of a host TMA descriptor, or None for any other value."""
    if isinstance(v, TensorDescriptor):
        return f"tensordesc<{TYPES[v.base.dtype]}[{','.join(str(b) for b in v.block_shape)}]>"
    return None


def signature(fn, args, kwargs, descriptor=_host_descriptor, option_names=("num_warps", "num_stages")):
    """The signature, constants, attributes and options Triton's launcher would compile these
    arguments with. Like a real launch (JITFunction.run), an int argument equal to 1 becomes a
    constant and one divisible by 16 (or a pointer aligned to 16 bytes) carries tt.divisibility = 16,
    unless the parameter is in do_not_specialize. Without those hints the compiler cannot prove
    16-byte alignment, loads fall back to scalars, and the register and spill figures are wrong.
    ``descriptor``: a TMA descriptor argument's signature type (None: not a descriptor);
    ``option_names``: the launch options passed on (scripts/gluon_check.py adds maxnreg)."""
    sig, const, attrs = {}, {}, {}
    values = dict(zip(fn.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    for index, name in enumerate(fn.arg_names):
        param = fn.params[index]
        v = values[name] if name in values else param.default      # a parameter left at its default
        if param.is_constexpr or v is None:
            sig[name] = "constexpr"
            const[name] = v
        elif descriptor(v) is not None:
            sig[name] = descriptor(v)
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
    options = {k: kwargs[k] for k in option_names if k in kwargs}
    return sig, const, attrs, options


# Registers one block may hold (every NVIDIA GPU from sm_80 to sm_120).
REGS_PER_BLOCK = 65536


class Stats:
    """Per-target tallies: kernels compiled, failed, reused (same signature as an earlier case)."""

    def __init__(self):
        self.compiled = self.failed = self.reused = self.refused = 0
        self.max_smem = 0
        self.seen = {}          # signature -> result line tail, so duplicates are not compiled twice


STATS = Stats()


def compile_calls(label, run, sass, dump_dir=None):
    """Run ``run()`` with every kernel module's kernels replaced by recorders; compile what they record
    for TARGET, and check it fits. ``dump_dir``: also write each kernel's SASS there (one file per
    label and kernel), for comparing two versions of the source byte for byte."""
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
    except (ChooserRefused, ValueError) as e:
        # The chooser's own error where no tile fits (the clear error users get instead of
        # Triton's OutOfResources at launch): reported, not a failure.
        if not isinstance(e, ChooserRefused) and "shared memory per block" not in str(e):
            raise
        STATS.refused += 1
        print(f"  --   {label:<44} refused by the chooser: {e}", flush=True)
        calls.clear()
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)
    ok = True
    calls_seen = []
    limit = TARGET.props.shared_memory_per_block_optin
    for fn, args, kwargs in calls:
        sig, const, attrs, options = signature(fn, args, kwargs)
        key = (fn.__name__, repr(sorted(sig.items())), repr(sorted(const.items(), key=str)),
               repr(sorted(attrs.items())), repr(sorted(options.items())))
        if key in STATS.seen and not dump_dir:
            STATS.reused += 1
            status, tail = STATS.seen[key]
            ok &= status == "ok"
            print(f"  {status:<4} {label:<44} {fn.__name__:<24} {tail} (as above)", flush=True)
            continue
        try:
            k = triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET.gpu, options=options)
            smem = k.metadata.shared
            STATS.max_smem = max(STATS.max_smem, smem)
            problems = []
            if smem > limit:
                problems.append(f"shared memory {smem} B > {limit} B per block")
            if TARGET.hip:
                info = f"smem {smem:6d}"
            else:
                usage = cuobjdump(k.asm["cubin"], "--dump-resource-usage")
                regs = re.search(r"REG:(\d+)", usage)
                # ptxas puts register spills in the per-thread stack frame (STACK), not in LOCAL.
                stack = re.search(r"STACK:(\d+)", usage)
                info = (f"regs {regs.group(1) if regs else '?':>3} stack(spills) bytes "
                        f"{stack.group(1) if stack else '?':>5} smem {smem:6d}")
                threads = 32 * options.get("num_warps", 4)
                if regs and int(regs.group(1)) * threads > REGS_PER_BLOCK:
                    problems.append(f"{regs.group(1)} registers x {threads} threads > {REGS_PER_BLOCK}")
                if sass:
                    dump = cuobjdump(k.asm['cubin'], '--dump-sass')
                    info += f" HGMMA {dump.count('HGMMA'):4d} STL {dump.count('STL'):5d}"
                if dump_dir:
                    name = re.sub(r"[^A-Za-z0-9]+", "_", f"{label} {fn.__name__} {len(calls_seen)}")
                    calls_seen.append(name)
                    with open(os.path.join(dump_dir, name + ".sass"), "w") as f:
                        f.write(cuobjdump(k.asm["cubin"], "--dump-sass"))
                    # The PTX too: where two SASS dumps differ, equal PTX says ptxas scheduled the same
                    # input differently (it does, run to run, for the largest fp32 kernels).
                    with open(os.path.join(dump_dir, name + ".ptx"), "w") as f:
                        f.write(k.asm["ptx"])
            if problems:
                status, tail = "FAIL", f"{info}  DOES NOT FIT: {'; '.join(problems)}"
            else:
                status, tail = "ok", info
        except Exception as e:  # noqa: BLE001 - report and go on
            status, tail = "FAIL", error_line(e)[:200]
        STATS.seen[key] = (status, tail)
        if status == "ok":
            STATS.compiled += 1
        else:
            STATS.failed += 1
            ok = False
        print(f"  {status:<4} {label:<44} {fn.__name__:<24} {tail}", flush=True)
    return ok


def error_line(e: BaseException) -> str:
    """The line that says what went wrong: Triton wraps the cause (an assertion in a dot, an MLIR
    pass failure) in a CompilationError whose own text is the source excerpt."""
    chain = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for exc in reversed(chain):
        lines = [m.strip() for m in str(exc).strip().splitlines() if m.strip() and m.strip() != "^"]
        if lines:
            line = next((m for m in lines if "error" in m.lower()), lines[-1])
            return f"{type(exc).__name__}: {line}"
    return type(chain[0]).__name__


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


def forward_cases(quick=False):
    for dtype in dtypes(quick):
        for d in ((64, 128, 256) if quick else (64, 128, 40, 256)):
            for causal in (False, True):
                q, k, v = qkv(2, 300, 300, 4, 2, d, dtype)
                # What the chooser picks on the target, for a long and a short problem. --quick: one
                # of each of the chooser's regimes (full at 4k: the widest tiles; causal at 512: the
                # short-problem ones).
                for sq in (4096, 512):
                    if quick and (sq == 512) != causal or quick and dtype == torch.float32 and causal:
                        continue
                    cfg = choose_forward(d, dtype, causal, 2 * 4, sq)
                    yield f"fwd {TYPES[dtype]} D{d} {'causal' if causal else 'full'} S{sq} {cfg.tma}", \
                        (lambda q=q, k=k, v=v, cfg=cfg, causal=causal:
                         dispatch.forward(q, k, v, 0.1, causal, config=cfg))


def varlen_cases(quick=False):
    """Packed sequences (flash_attn_varlen_func): the forward and backward Triton kernels with
    VARLEN, at the tiles the target's chooser picks."""
    lengths = torch.tensor([0, 300, 17, 1000], dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    vl = Varlen(cu, cu, 1000, 1000)
    total = int(cu[-1])
    for dtype in ((torch.float16,) if quick else (torch.float16, torch.bfloat16, torch.float32)):
        for d in ((128,) if quick else (64, 128, 256)):
            for causal in ((True,) if quick else (False, True)):
                q, k, v = (torch.randn(total, h, d, dtype=dtype) for h in (4, 2, 2))
                cfg = choose_forward(d, dtype, causal, 4 * 4, 1000)
                bcfg = choose_backward(d, dtype)
                lse = torch.randn(4, total)
                yield f"varlen {TYPES[dtype]} D{d} {'causal' if causal else 'full'}", \
                    (lambda q=q, k=k, v=v, cfg=cfg, bcfg=bcfg, lse=lse, causal=causal:
                     (dispatch.forward(q, k, v, 0.1, causal, config=cfg, varlen=vl),
                      dispatch.backward(torch.randn_like(q), q, k, v, torch.randn_like(q), lse, 0.1, causal,
                                 config=bcfg, varlen=vl)))
                yield f"varlen single {TYPES[dtype]} D{d} {'causal' if causal else 'full'}", \
                    (lambda q=q, k=k, v=v, lse=lse, causal=causal:
                     _single(q, k, v, torch.randn_like(q), lse, causal, varlen=vl))


def window_cases(quick=False):
    """Local windows (window_size): the forward's and backward's three-range loops, on the tiles and
    tile movement (TMA descriptors on Hopper) the choosers pick."""
    for dtype in ((torch.float16,) if quick else (torch.float16, torch.bfloat16, torch.float32)):
        for d in ((128,) if quick else (64, 128)):
            for causal, window in (((False, (100, 37)),) if quick else
                                   ((True, (256, 0)), (False, (100, 37)), (False, (-1, 5)))):
                q, k, v = qkv(2, 300, 300, 4, 2, d, dtype)
                cfg = choose_forward(d, dtype, causal, 2 * 4, 4096)
                bcfg = choose_backward(d, dtype)

                def run(q=q, k=k, v=v, cfg=cfg, bcfg=bcfg, causal=causal, window=window):
                    out, lse = dispatch.forward(q, k, v, 0.1, causal, config=cfg, window=window)
                    dispatch.backward(torch.randn_like(q), q, k, v, out, torch.randn(2, 4, 300), 0.1, causal,
                               config=bcfg, window=window)
                yield f"window{window} {TYPES[dtype]} D{d} {'causal' if causal else 'full'}", run
        if dtype != torch.bfloat16:
            cache = torch.randn(4, 1024, 2, 128, dtype=dtype)
            for splits in ((4,) if quick else (1, 4)):
                cfg = configs.DecodeConfig(block_m=16, block_n=32, num_warps=4, num_stages=2, num_splits=splits)

                def run_decode(cache=cache, cfg=cfg, dtype=dtype):
                    dispatch.decode(torch.randn(4, 3, 8, 128, dtype=dtype), cache, cache,
                               torch.full((4,), 200, dtype=torch.int32), None, 0, 200, 0.1, True, config=cfg,
                               window=(64, 0))
                yield f"window decode {TYPES[dtype]} splits{splits}", run_decode


def long_cases(quick=False):
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
                # A fixed tile, shrunk where the target's shared memory needs it (fp32 D=128 on 99 KB).
                cfg = configs.fit_forward(configs.FwdConfig(64, 64, 4, 2, tma="none"),
                                          block_d=configs.head_dim_block(d), elt=dtype.itemsize,
                                          facts=configs.device_facts("cuda"))
                bcfg = choose_backward(d, dtype)

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


class ChooserRefused(Exception):
    """The config chooser raised its clear error (no tile fits the target's shared memory)."""


class Refused:
    """What ``choose_backward`` returns where the chooser refuses: using it (unpacking the two
    configs) raises ChooserRefused inside the case's run, so the case is reported, not the group."""

    def __init__(self, message):
        self.message = message

    def __iter__(self):
        raise ChooserRefused(self.message)


def choose_backward(d, dtype):
    try:
        return configs.backward_config(head_dim=d, dtype=dtype, device="cuda")
    except ValueError as e:
        return Refused(str(e))


def dtypes(quick):
    """fp16 and bf16 get the same tiles: --quick compiles one of them."""
    return (torch.float16, torch.float32) if quick else (torch.float16, torch.bfloat16, torch.float32)


def choose_forward(d, dtype, causal, bh, sq):
    return configs.forward_config(head_dim=d, dtype=dtype, causal=causal, batch_heads=bh, seqlen_q=sq,
                                  device="cuda")


def backward_cases(quick=False):
    for dtype in dtypes(quick):
        for d in (64, 128, 256):
            for causal in ((True,) if quick else (False, True)):
                q, k, v = qkv(2, 300, 300, 4, 2, d, dtype)
                out = torch.randn_like(q)
                lse = torch.randn(2, 4, 300)
                cfg = choose_backward(d, dtype)
                yield f"bwd {TYPES[dtype]} D{d} {'causal' if causal else 'full'}", \
                    (lambda q=q, k=k, v=v, out=out, lse=lse, causal=causal, cfg=cfg:
                     dispatch.backward(torch.randn_like(q), q, k, v, out, lse, 0.1, causal, config=cfg))
                # The single-launch backward (short sequences; --quick: one of them).
                if quick and (d, dtype) != (128, torch.float16):
                    continue
                yield f"bwd single {TYPES[dtype]} D{d} {'causal' if causal else 'full'}", \
                    (lambda q=q, k=k, v=v, out=out, lse=lse, causal=causal: _single(q, k, v, out, lse, causal))
    # ... and with a window, softcap, ALiBi and a gradient on the LSE.
    if quick:
        return
    q, k, v = qkv(2, 300, 300, 4, 2, 128, torch.float16)
    yield "bwd single fp16 D128 window softcap alibi dlse", \
        (lambda: _single(q, k, v, torch.randn_like(q), torch.randn(2, 4, 300), False, window=(64, 16),
                         scores=ScoreVariant(30.0, torch.rand(4), None), dlse=torch.randn(2, 4, 300)))


def _single(q, k, v, out, lse, causal, **kwargs):
    with dispatch.force(backward=dispatch.SINGLE):
        dispatch.backward(torch.randn_like(q), q, k, v, out, lse, 0.1, causal, **kwargs)


def decode_cases(quick=False):
    for dtype in (torch.float16, torch.float32):
        for paged, page in (((False, 1), (True, 16), (True, 5)) if quick and dtype == torch.float16 else
                            ((False, 1),) if quick else ((False, 1), (True, 16), (True, 256), (True, 5))):
            q = torch.randn(4, 1, 32, 128, dtype=dtype)
            cache = torch.randn(64 if paged else 4, page if paged else 1024, 8, 128, dtype=dtype)
            table = torch.arange(64, dtype=torch.int32).view(4, 16) if paged else None
            seqlens = torch.full((4,), 200, dtype=torch.int32)
            kind = 'page' + str(page) if paged else 'contig'
            for splits in (() if quick else (1, 8)):
                cfg = configs.DecodeConfig(block_m=16,
                                           block_n=64 if dtype != torch.float32 else 32,
                                           num_warps=4, num_stages=3 if dtype != torch.float32 else 2,
                                           num_splits=splits)
                yield f"decode {TYPES[dtype]} {kind} splits{splits}", \
                    (lambda q=q, c=cache, t=table, s=seqlens, cfg=cfg:
                     dispatch.decode(q, c, c, s, t, 0, 200, 0.1, False, config=cfg))
            # What the chooser picks on the target for one long sequence and for a batch of 16.
            for batch in (1, 16):
                yield f"decode {TYPES[dtype]} {kind} auto B{batch}", \
                    (lambda q=q, c=cache, t=table, s=seqlens, b=batch:
                     dispatch.decode(q[:1].expand(b, -1, -1, -1), c, c, s[:1].expand(b),
                                     t[:1].expand(b, -1) if t is not None else None, 0, 8192, 0.1, False))
    # The chooser's tiles at the other head dims (D=64 takes twice the key block; D=256 the wide tiles).
    for d in (64, 256):
        q = torch.randn(16, 1, 32, d, dtype=torch.float16)
        cache = torch.randn(16, 1024, 8, d, dtype=torch.float16)
        seqlens = torch.full((16,), 200, dtype=torch.int32)
        for batch in (1, 16):
            yield f"decode fp16 D{d} contig auto B{batch}", \
                (lambda q=q, c=cache, s=seqlens, b=batch: dispatch.decode(q[:b], c[:b], c[:b], s[:b], None, 0, 8192,
                                                                          0.1, False))


def variant_cases(quick=False):
    """The score variants (softcap, ALiBi, sinks) compiled into the portable forward, backward and
    decode: fp16 takes the hardware tanh on NVIDIA targets, fp32 libdevice's."""
    every = ScoreVariant(30.0, torch.rand(4), torch.randn(4))
    # fp16's hardware tanh is PTX, chosen from the running torch (common.PTX_TANH): a ROCm torch takes
    # libdevice's, but this script runs on a CUDA or CPU torch, so AMD targets compile fp32 only here.
    for dtype in ((torch.float32,) if TARGET.hip else (torch.float16, torch.float32)):
        for d in ((128,) if quick else (64, 128)):
            q, k, v = qkv(2, 300, 300, 4, 2, d, dtype)
            out = torch.randn_like(q)
            lse = torch.randn(2, 4, 300)
            cfg = choose_forward(d, dtype, True, 8, 4096)
            bcfg = choose_backward(d, dtype)
            yield f"fwd variants {TYPES[dtype]} D{d} causal", \
                (lambda q=q, k=k, v=v, cfg=cfg: dispatch.forward(q, k, v, 0.1, True, config=cfg, scores=every))
            yield f"bwd variants {TYPES[dtype]} D{d} causal", \
                (lambda q=q, k=k, v=v, out=out, lse=lse, bcfg=bcfg:
                 dispatch.backward(torch.randn_like(q), q, k, v, out, lse, 0.1, True, config=bcfg, scores=every,
                                   dsink=torch.empty(4)))
        q = torch.randn(4, 1, 32, 128, dtype=dtype)
        cache = torch.randn(4, 1024, 8, 128, dtype=dtype)
        seqlens = torch.full((4,), 200, dtype=torch.int32)
        slopes = ScoreVariant(30.0, torch.rand(32), torch.randn(32))
        yield f"decode variants {TYPES[dtype]}", \
            (lambda q=q, c=cache, s=seqlens: dispatch.decode(q, c, c, s, None, 0, 200, 0.1, False, scores=slopes))


def merge_cases(quick=False):
    for d in ((64, 256) if quick else (16, 32, 64, 128, 256)):
        for parts in ((150,) if quick else (2, 8, 150)):
            for rows in (4, 32768):                     # one decode step; a long prefill's merge
                o = torch.empty(parts, 1, rows // 4, 4, d)
                lse = torch.empty(parts, 1, 4, rows // 4)
                yield f"merge D{d} parts{parts} rows{rows}", (lambda o=o, lse=lse: M.merge(o, lse))


GROUPS = {"forward": forward_cases, "backward": backward_cases, "varlen": varlen_cases, "window": window_cases,
          "long": long_cases, "decode": decode_cases, "variants": variant_cases, "merge": merge_cases}
# Fixed configs, not the choosers': code generation of the 64-bit offsets, the same on every target.
QUICK_SKIPS = ("long",)


def check_target(key, only=None, quick=False, sass=False, dump_dir=None):
    """Compile every group's cases for one target; returns (ok, summary line)."""
    global STATS
    target = TARGETS[key]
    use_target(target)
    STATS = Stats()
    start = time.perf_counter()
    p = target.props
    print(f"==== target {key}: {target.gpu.backend} {target.gpu.arch} ({p.name}; capability {p.major}.{p.minor}, "
          f"{p.multi_processor_count} SMs, {p.shared_memory_per_block_optin} B shared memory per block)",
          flush=True)
    if not target.hip:
        print(f"     assembler: {ptxas_version(target.gpu.arch)}", flush=True)
    ok = True
    for name, cases in GROUPS.items():
        if (only and only != name) or (quick and not only and name in QUICK_SKIPS):
            continue
        print(f"== {name} [{key}]", flush=True)
        try:
            for label, run in cases(quick):
                ok &= compile_calls(label, run, sass and not target.hip, dump_dir)
        except Exception as e:  # noqa: BLE001 - a chooser that raises is a failure of this target
            ok = False
            STATS.failed += 1
            print(f"  FAIL {name}: the launcher raised {type(e).__name__}: {e}", flush=True)
    summary = (f"{key:>7}: {'ok  ' if ok else 'FAIL'} {STATS.compiled:4d} compiled, {STATS.failed:3d} failed, "
               f"{STATS.reused:4d} reused, {STATS.refused:2d} refused; largest shared memory {STATS.max_smem:6d} of "
               f"{p.shared_memory_per_block_optin} B; {time.perf_counter() - start:5.0f} s")
    return ok, summary


def ptxas_version(arch: int) -> str:
    """The bundled assembler Triton uses for this capability (ptxas-blackwell from sm_100) and its release."""
    from triton.backends.nvidia import compiler as nv

    tool = nv.get_ptxas(arch)
    out = subprocess.run([tool.path, "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release [^\n]*", out)
    return f"{os.path.basename(tool.path)}, {release.group(0) if release else out.strip()[-60:]}"


def _worker(args):
    key, only, quick = args
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ok, summary = check_target(key, only, quick)
    return ok, summary, buf.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default=",".join(NVIDIA),
                    help=f"comma-separated targets from {','.join(TARGETS)}, or 'all' "
                         f"(default: the NVIDIA ones, {','.join(NVIDIA)})")
    ap.add_argument("--quick", action="store_true",
                    help="only the choosers' picks, one of fp16/bf16 (the CI subset)")
    ap.add_argument("--jobs", type=int, default=1, help="targets compiled in parallel (processes)")
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--only", choices=list(GROUPS))
    ap.add_argument("--sass-dump", metavar="DIR", help="write every kernel's SASS into DIR")
    a = ap.parse_args()
    keys = list(TARGETS) if a.arch == "all" else [k.strip().removeprefix("sm_") for k in a.arch.split(",")]
    unknown = [k for k in keys if k not in TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {unknown}; choose from {', '.join(TARGETS)}")
    if a.jobs > 1 and (a.sass or a.sass_dump):
        ap.error("--sass and --sass-dump run in one process: leave out --jobs")
    if a.sass_dump:
        os.makedirs(a.sass_dump, exist_ok=True)
    start = time.perf_counter()
    results = []
    if a.jobs > 1 and len(keys) > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(min(a.jobs, len(keys))) as pool:
            for ok, summary, text in pool.imap(_worker, [(k, a.only, a.quick) for k in keys]):
                print(text, end="", flush=True)
                results.append((ok, summary))
    else:
        for k in keys:
            results.append(check_target(k, a.only, a.quick, a.sass, a.sass_dump))
    print("==== summary (shared memory: the compiled kernel's, against the target's per-block limit)")
    for _, summary in results:
        print(summary)
    ok = all(r[0] for r in results)
    print(("all compiled and fit" if ok else "SOME FAILED") + f" ({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

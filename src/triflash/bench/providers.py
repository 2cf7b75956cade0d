"""The implementations compared by ``triflash bench`` (fwd / bwd / fwdbwd), one small class each.

A provider says which memory layout it wants its q, k, v in; the runner converts the canonical
[B, S, H, D] inputs to that layout (copies included) *before* anything is timed, so the timed call is
the provider's own function and nothing else. Optional packages are imported in ``load``; when one is
missing the provider is reported as unavailable, with the import error as the reason.

Layouts:

* ``bshd``   [batch, seqlen, heads, head_dim]: FlashAttention's (triflash.flash_attn_func, FA2/3/4);
* ``bhsd``   [batch, heads, seqlen, head_dim]: PyTorch's SDPA and the seeds' naive attention;
* ``tokens`` [batch * seqlen, heads, head_dim]: FlashInfer's ragged batch and triflash's packed
  (varlen) one (a view of bshd).

Packed sequences of different lengths (``--varlen``) come as [total, heads, head_dim] with the case's
``cu_seqlens``; providers with ``packed = True`` take them (FlashAttention's ``flash_attn_varlen_func``
and its peers, FlashInfer's ragged batch, SDPA through nested jagged tensors), the others are
unavailable there. The score variants (``--softcap``, ``--sinks``, ``--alibi``) go to the providers whose
``VARIANTS`` name the library's keyword for them (checked against the function's signature); the others
are unavailable there, with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch

from .workloads import VARIANT_NAMES, Workload


class Unavailable(Exception):
    """This provider cannot run here or on this workload; the message says why. Not an error."""


def to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Canonical [B, S, H, D] -> ``layout``, contiguous (a copy only for bhsd). Packed sequences
    ([total, H, D], 3-D) stay as they are: the providers that take them take that layout."""
    if layout == "bshd" or t.dim() == 3:
        return t
    if layout == "bhsd":
        return t.transpose(1, 2).contiguous()
    if layout == "tokens":
        return t.reshape(-1, t.shape[2], t.shape[3])
    raise ValueError(f"unknown layout {layout!r}")


def from_layout(t: torch.Tensor, layout: str, batch: int, packed: bool = False) -> torch.Tensor:
    """``layout`` -> a canonical [B, S, H, D] view (for checking only; never timed); packed
    sequences stay [total, H, D]."""
    if layout == "bshd" or packed:
        return t
    if layout == "bhsd":
        return t.transpose(1, 2)
    if layout == "tokens":
        return t.view(batch, -1, t.shape[1], t.shape[2])
    raise ValueError(f"unknown layout {layout!r}")


def first(result):
    """Some libraries return (out, lse); keep the output."""
    return result[0] if isinstance(result, tuple) else result


def missing_keywords(fn, names) -> list[str]:
    """The keyword arguments among ``names`` that ``fn``'s signature lacks (none when it takes
    **kwargs, or when its signature cannot be read: then the call itself will tell)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [n for n in names if n not in params]


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}"


# The keyword names of FlashAttention's varlen entry points (triflash's, FA2's, FA3's and FA4's).
VARLEN_KEYWORDS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


@dataclass
class Prepared:
    """What the timed call needs, made before any timing: the arguments of ``run`` and, in the modes
    with a backward, the leaf tensors to differentiate and ``dout``, all in the provider's layout."""

    args: tuple
    leaves: tuple = ()
    dout: torch.Tensor | None = None


class Provider:
    """Base class of the fwd/bwd/fwdbwd providers.

    Subclasses set ``name``, ``description`` and ``layout``, and import their library in ``load``,
    setting ``self.fn`` to a ``fn(q, k, v, causal=...)`` that ``run`` calls (override ``run`` for any
    other signature). Packed providers also set ``self.varlen_fn``, FlashAttention's
    ``flash_attn_varlen_func(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=, ...)``
    (or override ``run``).
    """

    name = ""
    description = ""
    layout = "bshd"
    default = True          # run when --providers is not given
    windows = False         # takes a local window (FlashAttention's window_size); else unavailable there
    packed = False          # takes packed sequences of different lengths (--varlen); else unavailable there
    VARIANTS: dict[str, str] = {}    # score variant ("softcap", "sinks", "alibi") -> the library's keyword
    window = None           # the workload's window, set by the runner before setup
    fn = None
    varlen_fn = None
    packing = None          # (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for varlen_fn, else None
    call_kwargs: dict = {}      # the window's and the variants' keywords of every timed call (set in prepare)

    def load(self) -> None:
        """Import what the provider needs (once per run); raise ImportError or Unavailable."""

    def setup(self, wl: Workload, device) -> None:
        """Per-workload preparation outside the timed region; raise Unavailable if unsupported."""

    def context(self):
        """A context manager entered around the check and the timing (outside the timed calls)."""
        return contextlib.nullcontext()

    def prepare(self, case, requires_grad: bool) -> Prepared:
        """Convert the case's canonical inputs to this provider's layout (copies happen here)."""
        self.take_keywords(case)
        if getattr(case, "cu_seqlens", None) is not None:
            longest = case.workload.seqlen_q
            self.packing = (case.cu_seqlens, case.cu_seqlens, longest, longest)
        q, k, v = (to_layout(t, self.layout) for t in (case.q, case.k, case.v))
        if not requires_grad:
            return Prepared((q, k, v, case.workload.causal))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        return Prepared((q, k, v, case.workload.causal), (q, k, v), to_layout(case.dout, self.layout))

    def canonical(self, t: torch.Tensor, wl: Workload) -> torch.Tensor:
        """An output or gradient in this provider's layout -> a [B, S, H, D] view (packed sequences:
        [total, H, D]), for the check."""
        return from_layout(t, self.layout, wl.batch, packed=wl.seqlens is not None)

    def run(self, q, k, v, causal: bool) -> torch.Tensor:
        if self.packing is not None:
            cu_q, cu_k, max_q, max_k = self.packing
            return first(self.varlen_fn(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                        max_seqlen_k=max_k, causal=causal, **self.call_kwargs))
        return first(self.fn(q, k, v, causal=causal, **self.call_kwargs))

    def take_keywords(self, case) -> None:
        """Every timed call's keywords (``call_kwargs``): the window's and the case's score variants',
        built once here, not in each call (host mode times the call itself)."""
        self.call_kwargs = {**self.window_kwargs(), **self.variant_kwargs(case.variants)}

    def window_kwargs(self) -> dict:
        """The window in FlashAttention's ``window_size`` convention (nothing without one)."""
        return {} if self.window is None else {"window_size": tuple(self.window)}

    def variant_kwargs(self, variants) -> dict:
        """The case's score variants (``checking.ScoreVariants``) as this library's keywords."""
        out = {}
        if variants.softcap:
            out[self.VARIANTS["softcap"]] = variants.softcap
        if variants.sinks is not None:
            out[self.VARIANTS["sinks"]] = self.sinks_argument(variants.sinks)
        if variants.alibi_slopes is not None:
            out[self.VARIANTS["alibi"]] = variants.alibi_slopes
        return out

    def sinks_argument(self, sinks: torch.Tensor) -> torch.Tensor:
        """The sinks (float32 [Hq]) as this library takes them."""
        return sinks

    def bind(self, wl: Workload) -> None:
        """Take the workload's window, packing and score variants, or refuse them (called after
        ``load``, before ``setup``)."""
        if wl.window is not None and not self.windows:
            raise Unavailable(f"{self.name} takes no local window")
        if wl.seqlens is not None and not self.packed:
            raise Unavailable(f"{self.name} takes no packed sequences of different lengths (varlen)")
        missing = [v for v in wl.variants if v not in self.VARIANTS]
        if missing:
            names = [VARIANT_NAMES[v] for v in missing]
            listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
            raise Unavailable(f"{self.name} takes no {listed}")
        own_run = type(self).run is Provider.run
        fn = self.entry_point(wl)
        if fn is None and own_run and wl.seqlens is not None:
            raise Unavailable(f"{self.name}: its library has no flash_attn_varlen_func")
        if fn is not None:
            needed = [self.VARIANTS[v] for v in wl.variants]
            if fn is self.varlen_fn and own_run:
                needed = [*VARLEN_KEYWORDS, *needed]
            absent = missing_keywords(fn, needed)
            if absent:
                raise Unavailable(f"{self.name}: {_qualname(fn)} takes no " + ", ".join(f"{a}=" for a in absent)
                                  + " (another version of the library?)")
        self.window = wl.window
        self.packing = None
        self.call_kwargs = {}

    def entry_point(self, wl: Workload):
        """The library function ``run`` will call on ``wl`` (its signature is checked in ``bind``)."""
        return self.varlen_fn if wl.seqlens is not None else self.fn


TRIFLASH_VARIANTS = {"softcap": "softcap", "sinks": "sinks", "alibi": "alibi_slopes"}


class Triflash(Provider):
    """triflash.flash_attn_func; packed sequences (--varlen) through triflash.flash_attn_varlen_func."""

    name = "triflash"
    description = "triflash.flash_attn_func (packed: flash_attn_varlen_func)"
    windows = True
    packed = True
    VARIANTS = TRIFLASH_VARIANTS

    def load(self):
        import triflash

        self.fn = triflash.flash_attn_func
        self.varlen_fn = triflash.flash_attn_varlen_func


class TriflashForced(Triflash):
    """triflash.flash_attn_func with the kernel choice forced (``dispatch.force``): ``triflash@triton``
    runs the portable Triton kernels, ``triflash@NAME`` the Gluon forward or backward variant NAME,
    ``triflash@FWD+BWD`` both. Call plans are off while forced. The variant runner of scripts/tune.py."""

    default = False

    def __init__(self, choice: str):
        self.choice = choice
        self.name = f"triflash@{choice}"
        self.description = f"triflash.flash_attn_func, kernels forced: {choice}"

    def load(self):
        super().load()
        from triflash.kernels import dispatch

        forward_names, backward_names = dispatch.variant_names()
        self.force = {}
        for part in self.choice.split("+"):
            if part == dispatch.TRITON:
                self.force.update(forward=part, backward=part)
            elif part in forward_names:
                self.force["forward"] = part
            elif part in backward_names:
                self.force["backward"] = part
            else:
                raise Unavailable(f"no kernel variant {part!r} here (forward: {', '.join(forward_names) or 'none'}; "
                                  f"backward: {', '.join(backward_names) or 'none'}; or 'triton')")

    def context(self):
        from triflash.kernels import dispatch

        return dispatch.force(**self.force)


def forced_provider(name: str) -> TriflashForced | None:
    """The provider a ``triflash@...`` name asks for, or None for any other name."""
    return TriflashForced(name.split("@", 1)[1]) if name.startswith("triflash@") and len(name) > 9 else None


class TriflashVarlen(Provider):
    """triflash.flash_attn_varlen_func on the batch packed as equal-length sequences: what the packed
    path costs against ``triflash`` at the same shapes (the offsets' opt-in host check stays off,
    its default, as FlashAttention has none). On packed workloads (--varlen) the same as ``triflash``."""

    name = "triflash-varlen"
    layout = "tokens"
    default = False
    windows = True
    packed = True
    VARIANTS = TRIFLASH_VARIANTS
    description = "triflash.flash_attn_varlen_func (equal lengths)"

    def load(self):
        import triflash

        self.varlen_fn = triflash.flash_attn_varlen_func

    def entry_point(self, wl):
        return self.varlen_fn

    def setup(self, wl, device):
        if wl.seqlens is None:
            cu_q = torch.arange(wl.batch + 1, dtype=torch.int32, device=device) * wl.seqlen_q
            cu_k = torch.arange(wl.batch + 1, dtype=torch.int32, device=device) * wl.seqlen_k
            self.packing = (cu_q, cu_k, wl.seqlen_q, wl.seqlen_k)


class Naive(Provider):
    name = "naive"
    layout = "bhsd"
    description = "triflash.reference.naive_attention (the seeds' PyTorch version)"

    def load(self):
        from ..reference import naive_attention

        self.fn = naive_attention

    def setup(self, wl, device):
        if wl.heads_kv != wl.heads:
            raise Unavailable("naive_attention has one K/V head per query head (no GQA)")


class Sdpa(Provider):
    """torch.nn.functional.scaled_dot_product_attention with one backend forced. Packed sequences
    (--varlen) go in as nested jagged tensors (``torch.nested.nested_tensor_from_jagged`` on the
    packed tensors and the offsets, [B, j, H, D] transposed to SDPA's [B, H, j, D]), which SDPA hands
    to its flash, efficient and cuDNN kernels' varlen paths on CUDA. SDPA has no score variants."""

    layout = "bhsd"
    packed = True
    BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}

    def __init__(self, backend: str):
        self.backend = backend
        self.name = f"sdpa-{backend}"
        self.description = f"PyTorch SDPA, {backend} backend forced"

    def load(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.sdpa_kernel = sdpa_kernel
        self.sdpa_backend = getattr(SDPBackend, self.BACKENDS[self.backend])

    def setup(self, wl, device):
        # enable_gqa exists from torch 2.5 on: pass it only when K/V have fewer heads.
        self.extra = {"enable_gqa": True} if wl.heads_kv != wl.heads else {}

    def context(self):
        return self.sdpa_kernel([self.sdpa_backend])

    def bind(self, wl):
        super().bind(wl)
        if wl.seqlens is not None:
            if wl.heads_kv != wl.heads:
                raise Unavailable("SDPA on nested (jagged) tensors takes no GQA (enable_gqa is for dense inputs)")
            if self.backend == "math" and wl.causal:
                raise Unavailable("SDPA's math backend takes no is_causal with nested (jagged) tensors")

    def prepare(self, case, requires_grad):
        if not case.packed:
            return super().prepare(case, requires_grad)
        offsets = case.cu_seqlens.to(torch.int64)
        lengths = case.workload.seqlens
        try:
            def nested(t, grad=False):
                # One offsets tensor for all: their ragged dimension is the same symbol (j1).
                out = torch.nested.nested_tensor_from_jagged(t.detach(), offsets, min_seqlen=min(lengths),
                                                             max_seqlen=max(lengths))
                return out.requires_grad_() if grad else out

            q, k, v = (nested(t, requires_grad) for t in (case.q, case.k, case.v))
        except (AttributeError, TypeError, RuntimeError) as exc:
            raise Unavailable(f"torch {torch.__version__} makes no nested jagged tensors here: {exc}") from exc
        if not requires_grad:
            return Prepared((q, k, v, case.workload.causal))
        return Prepared((q, k, v, case.workload.causal), (q, k, v), nested(case.dout))

    def canonical(self, t, wl):
        if wl.seqlens is not None:
            return t.values()                      # [B, j, H, D] nested -> packed [total, H, D]
        return super().canonical(t, wl)

    def run(self, q, k, v, causal):
        if q.is_nested:                            # [B, j, H, D] -> SDPA's [B, H, j, D], and back
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, **self.extra)


class FlashAttn2(Provider):
    name = "fa2"
    description = "flash_attn.flash_attn_func (FlashAttention 2; packed: flash_attn_varlen_func)"
    windows = True
    packed = True
    VARIANTS = {"softcap": "softcap", "alibi": "alibi_slopes"}

    def load(self):
        import flash_attn
        from flash_attn import flash_attn_func

        version = getattr(flash_attn, "__version__", "?")
        if not version.startswith("2."):
            raise Unavailable(f"flash_attn {version} is not FlashAttention 2")
        self.fn = flash_attn_func
        self.varlen_fn = getattr(flash_attn, "flash_attn_varlen_func", None)


class FlashAttn3(Provider):
    name = "fa3"
    description = "flash_attn_interface.flash_attn_func (FlashAttention 3, Hopper; packed: flash_attn_varlen_func)"
    windows = True
    packed = True
    VARIANTS = {"softcap": "softcap"}

    def load(self):
        import flash_attn_interface

        self.fn = flash_attn_interface.flash_attn_func
        self.varlen_fn = getattr(flash_attn_interface, "flash_attn_varlen_func", None)


def fa4_variant_checks(wl: Workload, module_name: str, function_class: str) -> None:
    """What FlashAttention 4 cannot do with a workload's score variants, as Unavailable: learnable
    sinks need sm90+; and a version whose backward asserts ``softcap == 0`` has no softcap backward."""
    if wl.sinks and torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
        major, minor = torch.cuda.get_device_capability()
        raise Unavailable(f"FA4's learnable sinks need sm90+ (this GPU is sm{major}{minor})")
    if wl.softcap and wl.mode in ("bwd", "fwdbwd"):
        import importlib

        try:
            source = inspect.getsource(getattr(importlib.import_module(module_name), function_class).backward)
        except (ImportError, AttributeError, OSError, TypeError):
            return                                 # cannot tell: the call will
        if "softcap == 0.0" in source:
            raise Unavailable("FA4's backward takes no softcap in this version (it asserts softcap == 0.0)")


class FlashAttn4(Provider):
    """FlashAttention 4; packed sequences through flash_attn.cute.flash_attn_varlen_func. Soft-capping
    as ``softcap``; sinks as ``learnable_sink`` (bfloat16 [Hq], sm90+; the bench's sinks are bfloat16
    values, so nothing is rounded); no ALiBi."""

    name = "fa4"
    description = "flash_attn.cute.flash_attn_func (FlashAttention 4, CuTe DSL; packed: flash_attn_varlen_func)"
    windows = True
    packed = True
    VARIANTS = {"softcap": "softcap", "sinks": "learnable_sink"}

    def load(self):
        import flash_attn.cute as cute

        self.fn = cute.flash_attn_func
        self.varlen_fn = getattr(cute, "flash_attn_varlen_func", None)

    def setup(self, wl, device):
        fa4_variant_checks(wl, self.fn.__module__,
                           "FlashAttnVarlenFunc" if wl.seqlens is not None else "FlashAttnFunc")

    def sinks_argument(self, sinks):
        return sinks.to(torch.bfloat16)

    def window_kwargs(self) -> dict:
        # FA4's window_size takes None for "no bound" where FA2/3 take -1.
        return {} if self.window is None else {"window_size": tuple(None if w < 0 else w for w in self.window)}


class FlashInfer(Provider):
    """FlashInfer's batch prefill over a ragged batch of contiguous K/V (equal lengths, or the packed
    sequences of --varlen).

    ``single_prefill_with_kv_cache`` takes one sequence only; the batch wrapper runs the whole batch in
    one launch. Its ``plan`` (scheduling metadata) is made per workload, outside the timing.
    """

    name = "flashinfer"
    layout = "tokens"
    packed = True
    description = "flashinfer.BatchPrefillWithRaggedKVCacheWrapper (plan outside the timing)"
    WORKSPACE_BYTES = 128 * 1024 * 1024

    def load(self):
        import flashinfer

        self.flashinfer = flashinfer

    def setup(self, wl, device):
        workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = self.flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        if wl.seqlens is not None:
            from .checking import cu_seqlens_of

            indptr_q = indptr_k = cu_seqlens_of(wl.seqlens, device)
        else:
            indptr_q = torch.arange(wl.batch + 1, dtype=torch.int32, device=device) * wl.seqlen_q
            indptr_k = torch.arange(wl.batch + 1, dtype=torch.int32, device=device) * wl.seqlen_k
        self.wrapper.plan(indptr_q, indptr_k, wl.heads, wl.heads_kv, wl.head_dim, causal=wl.causal,
                          q_data_type=wl.torch_dtype)

    def run(self, q, k, v, causal):
        return self.wrapper.run(q, k, v)


def _drill_providers() -> list[Provider]:
    """drill:t5 / drill:t5-solution (drills/bench_hook.py), where the repository's drills/ is present
    (an installed wheel has none). Run only when named."""
    hook = _drill_hook()
    return hook.drill_providers() if hook is not None else []


@functools.cache
def _drill_hook():
    """drills/bench_hook.py, loaded once (None without the repository's drills/)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "drills" / "bench_hook.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("triflash_drills_bench_hook", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dense_providers() -> list[Provider]:
    """Every fwd/bwd/fwdbwd provider, in the order of the tables."""
    return [Triflash(), TriflashVarlen(), Naive(), *(Sdpa(b) for b in Sdpa.BACKENDS), FlashAttn2(), FlashAttn3(),
            FlashAttn4(), FlashInfer(), *_drill_providers()]

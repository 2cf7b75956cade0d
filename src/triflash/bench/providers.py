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
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from .workloads import Workload


class Unavailable(Exception):
    """This provider cannot run here or on this workload; the message says why. Not an error."""


def to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Canonical [B, S, H, D] -> ``layout``, contiguous (a copy only for bhsd)."""
    if layout == "bshd":
        return t
    if layout == "bhsd":
        return t.transpose(1, 2).contiguous()
    if layout == "tokens":
        return t.reshape(-1, t.shape[2], t.shape[3])
    raise ValueError(f"unknown layout {layout!r}")


def from_layout(t: torch.Tensor, layout: str, batch: int) -> torch.Tensor:
    """``layout`` -> a canonical [B, S, H, D] view (for checking only; never timed)."""
    if layout == "bshd":
        return t
    if layout == "bhsd":
        return t.transpose(1, 2)
    if layout == "tokens":
        return t.view(batch, -1, t.shape[1], t.shape[2])
    raise ValueError(f"unknown layout {layout!r}")


def first(result):
    """Some libraries return (out, lse); keep the output."""
    return result[0] if isinstance(result, tuple) else result


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
    other signature).
    """

    name = ""
    description = ""
    layout = "bshd"
    default = True          # run when --providers is not given
    windows = False         # takes a local window (FlashAttention's window_size); else unavailable there
    window = None           # the workload's window, set by the runner before setup

    def load(self) -> None:
        """Import what the provider needs (once per run); raise ImportError or Unavailable."""

    def setup(self, wl: Workload, device) -> None:
        """Per-workload preparation outside the timed region; raise Unavailable if unsupported."""

    def context(self):
        """A context manager entered around the check and the timing (outside the timed calls)."""
        return contextlib.nullcontext()

    def prepare(self, case, requires_grad: bool) -> Prepared:
        """Convert the case's canonical inputs to this provider's layout (copies happen here)."""
        q, k, v = (to_layout(t, self.layout) for t in (case.q, case.k, case.v))
        if not requires_grad:
            return Prepared((q, k, v, case.workload.causal))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        return Prepared((q, k, v, case.workload.causal), (q, k, v), to_layout(case.dout, self.layout))

    def canonical(self, t: torch.Tensor, wl: Workload) -> torch.Tensor:
        """An output or gradient in this provider's layout -> a [B, S, H, D] view, for the check."""
        return from_layout(t, self.layout, wl.batch)

    def run(self, q, k, v, causal: bool) -> torch.Tensor:
        return first(self.fn(q, k, v, causal=causal, **self.window_kwargs()))

    def window_kwargs(self) -> dict:
        """The window in FlashAttention's ``window_size`` convention (nothing without one)."""
        return {} if self.window is None else {"window_size": tuple(self.window)}

    def bind(self, wl: Workload) -> None:
        """Take the workload's window, or refuse it (called before ``setup``)."""
        if wl.window is not None and not self.windows:
            raise Unavailable(f"{self.name} takes no local window")
        self.window = wl.window


class Triflash(Provider):
    name = "triflash"
    description = "triflash.flash_attn_func"
    windows = True

    def load(self):
        import triflash

        self.fn = triflash.flash_attn_func


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
    its default, as FlashAttention has none)."""

    name = "triflash-varlen"
    layout = "tokens"
    default = False
    windows = True
    description = "triflash.flash_attn_varlen_func (equal lengths)"

    def load(self):
        import triflash

        self.fn = triflash.flash_attn_varlen_func

    def setup(self, wl, device):
        self.cu_q = torch.arange(wl.batch + 1, dtype=torch.int32, device=device) * wl.seqlen_q
        self.cu_k = torch.arange(wl.batch + 1, dtype=torch.int32, device=device) * wl.seqlen_k
        self.max_seqlens = (wl.seqlen_q, wl.seqlen_k)

    def run(self, q, k, v, causal):
        return self.fn(q, k, v, self.cu_q, self.cu_k, *self.max_seqlens, causal=causal, **self.window_kwargs())


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
    """torch.nn.functional.scaled_dot_product_attention with one backend forced."""

    layout = "bhsd"
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

    def run(self, q, k, v, causal):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, **self.extra)


class FlashAttn2(Provider):
    name = "fa2"
    description = "flash_attn.flash_attn_func (FlashAttention 2)"
    windows = True

    def load(self):
        import flash_attn
        from flash_attn import flash_attn_func

        version = getattr(flash_attn, "__version__", "?")
        if not version.startswith("2."):
            raise Unavailable(f"flash_attn {version} is not FlashAttention 2")
        self.fn = flash_attn_func


class FlashAttn3(Provider):
    name = "fa3"
    description = "flash_attn_interface.flash_attn_func (FlashAttention 3, Hopper)"
    windows = True

    def load(self):
        from flash_attn_interface import flash_attn_func

        self.fn = flash_attn_func


class FlashAttn4(Provider):
    name = "fa4"
    description = "flash_attn.cute.flash_attn_func (FlashAttention 4, CuTe DSL)"
    windows = True

    def load(self):
        from flash_attn.cute import flash_attn_func

        self.fn = flash_attn_func

    def window_kwargs(self) -> dict:
        # FA4's window_size takes None for "no bound" where FA2/3 take -1.
        return {} if self.window is None else {"window_size": tuple(None if w < 0 else w for w in self.window)}


class FlashInfer(Provider):
    """FlashInfer's batch prefill over a ragged (here: equal-length) batch of contiguous K/V.

    ``single_prefill_with_kv_cache`` takes one sequence only; the batch wrapper runs the whole batch in
    one launch. Its ``plan`` (scheduling metadata) is made per workload, outside the timing.
    """

    name = "flashinfer"
    layout = "tokens"
    description = "flashinfer.BatchPrefillWithRaggedKVCacheWrapper (plan outside the timing)"
    WORKSPACE_BYTES = 128 * 1024 * 1024

    def load(self):
        import flashinfer

        self.flashinfer = flashinfer

    def setup(self, wl, device):
        workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = self.flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
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

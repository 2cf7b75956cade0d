"""Which kernel runs a call: every choice of kernel family, variant and config, in one place.

Layers, one way: public function (api, kvcache) -> custom op / autograd -> this module -> kernel
modules (leaves: kernels + their launchers) -> launch.run. The kernel modules never import each
other's launchers and never choose; the Hopper (Gluon) modules are imported here, lazily, because
Gluon is optional (Triton < 3.5 lacks it: ``configs.gluon_available``).

Kernel families:

* forward: the Gluon Hopper kernel (``forward_hopper``, sm_90, fp16/bf16, head dim 64/128, local
  windows and packed sequences too, ``GLUON_PACKED``) in the variant ``forward_variant``
  picks; else the portable Triton kernel (``forward``) with ``configs.forward_config``'s tiles;
* backward: ``preprocess`` (delta, lse2), then dK/dV and dQ from the Gluon kernels
  (``backward_variant``; with a window or packed sequences the dK/dV-only variants, packed
  sequences at the head dims of ``GLUON_PACKED_BACKWARD`` or when forced) or the Triton ones
  (``configs.backward_config``); short problems on a GPU take the single-launch backward where
  ``single_launch_suits`` says so (the Triton kernels' programs in one launch, no preprocess; up to
  ``SINGLE_MAX_WORK``);
* decode: the Gluon decode kernel or the Triton one (``configs.decode_config`` chooses both the
  kernel and the split count), then ``merge`` of the split partials;
* merge (``merge_attn_states``): one kernel, ``merge``.

``variant`` arguments force a family: ``"triton"`` the portable kernels, a Gluon variant name that
variant (where its inputs allow it), None the rules below. The backward also takes ``"atomic"``: the
portable kernels with dQ accumulated by atomics (not deterministic), on every input the portable
kernels take; and ``"single"``: the single-launch backward, on inputs without sinks where all three
gradients are wanted (elsewhere the rules below).

Score variants (``scores``: softcap, ALiBi, attention sinks; [Note: score variants] in common.py) run on
the Gluon forward and backward where those apply and ``GLUON_FORWARD_SCORES`` /
``GLUON_BACKWARD_SCORES`` list them for the head dim (a forced Gluon variant takes any), and elsewhere
on the portable Triton kernels. Both decode kernels take them (and windows); the chooser gives them
the Gluon one by the plain rule while ``GLUON_DECODE_VARIANTS`` is on (the Triton one when off).
``force()`` makes the choice for calls made through the public functions (tests and benchmarks), without
replacing any function.
The measurements behind each rule: docs/performance.md and docs/performance-notes.md.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from . import backward as triton_backward
from . import configs, launch
from . import decode as triton_decode
from . import forward as triton_forward
from . import merge as triton_merge
from .block_ranges import window_bounds
from .common import PLAIN, ScoreVariant, Varlen, last_dim_contiguous, on_input_device
from .configs import BwdConfig, DecodeConfig, FwdConfig

TRITON = "triton"
# The portable Triton backward with dQ added by the dK/dV kernel through atomics (backward.py's
# [Note: atomic dQ]): a backward variant, not deterministic.
ATOMIC = "atomic"
# The single-launch backward (backward.py's [Note: single-launch backward]): a backward variant.
SINGLE = "single"

# --------------------------------------------------------------------------------------------------
# Forced choices (tests, benchmarks)
# --------------------------------------------------------------------------------------------------

_forced = {"forward": None, "backward": None}
_force_lock = threading.Lock()


@contextlib.contextmanager
def force(*, forward: str | None = None, backward: str | None = None):
    """Within the block, every call takes the given forward / backward variant (``"triton"``, a Gluon
    variant name, or for the backward ``"atomic"`` or ``"single"``) wherever the choosers would have been asked.
    Process-wide, not per thread: autograd runs a GPU backward on its own thread. Call plans are off
    inside (a plan recorded under one choice must not replay under another)."""
    with _force_lock:
        saved = (dict(_forced), launch.ENABLED)
        _forced.update(forward=forward, backward=backward)
        launch.ENABLED = False
    try:
        yield
    finally:
        with _force_lock:
            _forced.update(saved[0])
            launch.ENABLED = saved[1]


def variant_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(forward, backward) variant names ``force`` takes besides ``"triton"``: the Gluon variants this
    Triton can run (none without Gluon's Hopper API) and, for the backward, ``"atomic"`` (the portable
    kernels with atomic dQ, everywhere) and ``"single"`` (the single-launch backward)."""
    if not configs.gluon_available():
        return (), (ATOMIC, SINGLE)
    from . import backward_hopper, forward_hopper

    return tuple(forward_hopper.VARIANTS), (*backward_hopper.VARIANTS, ATOMIC, SINGLE)


def _forced_variant(kind: str) -> str | None:
    return _forced[kind]


# --------------------------------------------------------------------------------------------------
# AMD (ROCm)
# --------------------------------------------------------------------------------------------------

def amd_unsupported(facts: configs.DeviceFacts, dtype, what: str) -> str | None:
    """Why ``what`` ("forward", "backward", "decode", "merge") cannot run on this AMD GPU, or None.
    The portable kernels compile for MI300 (gfx942, capability 9.4 and later) in fp16/bf16, forward
    and backward (scripts/compile_check.py --arch gfx942); fp32 (libdevice's rounding intrinsics),
    decode and merging, and MI200 (gfx90a: no tf32 dot) do not compile yet. Nothing has run on AMD."""
    if not facts.is_hip:
        return None
    if (facts.major, facts.minor) < (9, 4):
        return f"{facts.name or 'this AMD GPU'} (capability {facts.major}.{facts.minor}): only MI300 (gfx942) and newer"
    if what not in ("forward", "backward"):
        return f"{what} on AMD GPUs"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{dtype} on AMD GPUs (fp16 and bf16 only)"
    return None


def _check_backend(t: torch.Tensor, what: str) -> None:
    """Raise a clear NotImplementedError where a ROCm build would fail to compile a kernel."""
    if t.is_cuda and torch.version.hip is not None:
        why = amd_unsupported(configs.device_facts(t.device), t.dtype, what)
        if why is not None:
            raise NotImplementedError(f"triflash does not run {why} yet (its kernels do not compile there); "
                                      f"use torch.nn.functional.scaled_dot_product_attention")


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------

# The Gluon forward's variants the chooser takes (forward_hopper.VARIANTS), per head dim and dtype.
HOPPER_FORWARD_VARIANTS = {
    64: {"float16": ("pp_persist", "pp3_persist_ltc"), "bfloat16": ("pp_persist", "pp3_persist")},
    128: {"float16": ("pp", "pp_persist"), "bfloat16": ("pp", "pp_persist")},
}


# The score variants the Gluon kernels take unless a variant is forced, per head dim; a call with any
# other goes to the Triton kernels. Measured on the H100 and the H200
# (docs/performance.md#score-variants-on-hopper): the forward with softcap at head dim 64 ties with the
# Triton kernel there (both bound by the MUFU, which the exp2 and the tanh share), and the Gluon dK/dV
# kernel spills with ALiBi at 64 (3.8x slower).
GLUON_FORWARD_SCORES = {64: frozenset({"sinks", "alibi"}), 128: frozenset({"sinks", "alibi", "softcap"})}
GLUON_BACKWARD_SCORES = {64: frozenset({"sinks", "softcap"}), 128: frozenset({"sinks", "alibi", "softcap"})}


def gluon_takes(scores: ScoreVariant, table: dict, head_dim: int) -> bool:
    """Whether the chooser may take a Gluon kernel for a call with these score variants."""
    return scores.names <= table.get(head_dim, frozenset())


def forward_candidates(head_dim: int, dtype, packed: bool = False) -> tuple[str, ...]:
    """Every variant ``forward_variant`` can take for this head dim and dtype (the GPU tests force each);
    ``packed``: for packed sequences, which never take an ``_ltc`` form (its plain form instead)."""
    names = HOPPER_FORWARD_VARIANTS[head_dim][str(dtype).removeprefix("torch.")]
    return tuple(dict.fromkeys(n.removesuffix("_ltc") for n in names)) if packed else names


# At head dim 64 a local window seen whole by fewer keys than this (left + right + 1) keeps the
# Triton forward; below the second bound the Gluon forward takes two warpgroups (``pp_persist``).
# Measured causal on the H100 (docs/performance.md#packed-sequences-and-local-windows).
GLUON_WINDOW_MIN_KEYS_D64 = 2048
GLUON_WINDOW_PP3_KEYS_D64 = 4096


def forward_variant(*, head_dim: int, dtype, device, causal: bool, seqlen_q: int, seqlen_k: int,
                    window: tuple[int, int] | None = None, packed: bool = False) -> str:
    """The forward's kernel: a Gluon variant or ``"triton"``. The rule (measured on H200 and H100,
    docs/performance-notes.md#forward-on-hopper):

    * head dim 128: persistent ``pp_persist``, except non-causal from 8k keys (``pp``, one tile per CTA);
      with a local window (``window_bounds``' (left, right)) always ``pp_persist``;
    * head dim 64: three consumer warpgroups (``pp3_persist``, fp16's ``_ltc`` form sums rows on the
      tensor cores) non-causal from 1k queries and causal from 2k queries and 2k keys; below that
      ``pp_persist``; causal below 2k queries the Triton kernel (faster there). With a window that
      shows each query fewer than ``GLUON_WINDOW_MIN_KEYS_D64`` keys the Triton kernel, fewer than
      ``GLUON_WINDOW_PP3_KEYS_D64`` ``pp_persist``, and never the ``_ltc`` form (its three loops of
      steps spill there, 88 bytes);
    * packed sequences (``packed``; seqlen_q / seqlen_k the longest): at head dim 128 ``pp`` (one tile
      per CTA: the tiles past a sequence's end cost a launch slot each, where the persistent orders
      balance the longest lengths' costs; docs/performance.md#packed-sequences-on-the-hopper-kernels),
      ``pp_persist`` with a window; at 64 the dense rule, never the ``_ltc`` form (it spills there).
    """
    if not configs.gluon_hopper_applies(head_dim=head_dim, dtype=dtype, device=device):
        return TRITON
    if head_dim == 128:
        if packed and window is None:
            return "pp"
        return "pp" if not causal and seqlen_k >= 8192 and window is None else "pp_persist"
    if causal and seqlen_q < 2048:
        return TRITON
    if window is not None:
        left, right = window
        span = left + right + 1 if left >= 0 and right >= 0 else None
        if span is not None and span < GLUON_WINDOW_MIN_KEYS_D64:
            return TRITON
        if span is not None and span < GLUON_WINDOW_PP3_KEYS_D64:
            return "pp_persist"
    ltc = "_ltc" if dtype == torch.float16 and window is None and not packed else ""
    if not causal:
        return f"pp3_persist{ltc}" if seqlen_q >= 1024 else "pp_persist"
    return f"pp3_persist{ltc}" if seqlen_k >= 2048 else "pp_persist"


# Packed sequences (``varlen``) on the Gluon forward: ``forward_variant``'s rule at the longest
# sequence's lengths (tests/test_varlen.py's Hopper cases pass on the H100;
# docs/performance.md#packed-sequences-on-the-hopper-kernels).
GLUON_PACKED = True
# The same for the backward (the Gluon dK/dV-only variants and dQ kernel on packed sequences): the head
# dims where it is taken unforced, with ``backward_variant``'s rule at the longest sequence's lengths.
# Head dim 128 only: there it beat the Triton kernels by 25% on the H100; at 64 the two were level
# (docs/performance.md#packed-sequences-on-the-hopper-kernels).
GLUON_PACKED_BACKWARD = frozenset({128})


@on_input_device
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool, *,
            out: torch.Tensor | None = None, config: FwdConfig | None = None, varlen: Varlen | None = None,
            window: tuple[int, int] | None = None, variant: str | None = None, scores: ScoreVariant = PLAIN):
    """Attention forward on validated [B, S, H, D] views (last stride 1): (out [B, Sq, Hq, D] in q's
    dtype, lse [B, Hq, Sq] float32 natural log). ``out`` may be a preallocated view with last stride
    1 (the [B, H, S, D] API passes a transposed one). ``varlen``: packed sequences, q / out
    [total_q, Hq, D], k / v [total_k, Hkv, D], lse [Hq, total_q]. ``window``: (left, right), -1 for
    no bound on a side. ``config`` forces the Triton kernel with those tiles; ``variant`` as in the
    module docstring. Packed sequences, windows and score variants (``scores``) run on either
    (packed sequences on the Gluon kernel while ``GLUON_PACKED``, or when a Gluon variant is forced)."""
    _check_backend(q, "forward")
    max_q, max_k = (varlen.max_seqlen_q, varlen.max_seqlen_k) if varlen is not None else (q.shape[1], k.shape[1])
    causal, window = window_bounds(window, causal, max_q, max_k)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    head_dim = q.shape[-1]
    heads_q = q.shape[-2]
    if varlen is None:
        batch = q.shape[0]
        if out.numel() == 0 or max_k == 0:
            lse = torch.empty((batch, heads_q, max_q), dtype=torch.float32, device=q.device)
            if out.numel():
                scores.fill_no_keys(out, lse)
            return out, lse
    else:
        batch = varlen.batch
    if config is None:
        variant = variant or _forced_variant("forward")
        if variant is None:
            rule = (varlen is None or GLUON_PACKED) and gluon_takes(scores, GLUON_FORWARD_SCORES, head_dim)
            variant = forward_variant(head_dim=head_dim, dtype=q.dtype, device=q.device, causal=causal,
                                      seqlen_q=max_q, seqlen_k=max_k, window=window,
                                      packed=varlen is not None) if rule else TRITON
        if variant != TRITON and configs.gluon_hopper_applies(head_dim=head_dim, dtype=q.dtype, device=q.device):
            from . import forward_hopper, sm90_common

            views = sm90_common.sequences(varlen, q, k, v, out)[3]
            if sm90_common.tma_supported(*views):
                return forward_hopper.forward_hopper(q, k, v, sm_scale, causal, out=out, variant=variant,
                                                     scores=scores, window=window, varlen=varlen)
        config = configs.forward_config(head_dim=head_dim, dtype=q.dtype, causal=causal,
                                        batch_heads=batch * heads_q, seqlen_q=max_q, device=q.device)
    if varlen is not None:
        return triton_forward.run_varlen(q, k, v, out, sm_scale, causal, config, varlen, window, scores)
    return triton_forward.run(q, k, v, out, sm_scale, causal, config, window, scores)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------

# The Gluon backward's variants the chooser takes (backward_hopper.VARIANTS), per head dim.
HOPPER_BACKWARD_VARIANTS = {64: ("dkdv", "dkdv_long"), 128: ("dkdv",)}
# At head dim 64 dQ comes from the Gluon dQ kernel (``dkdv_long``) from this many keys.
GLUON_DQ_MIN_KEYS_D64 = 4096
# Whether ``deterministic=False`` takes the atomic dQ kernels where the portable kernels run: not
# yet. On the H100 they were 1.26-1.49x slower than the deterministic Triton kernels at every timed
# shape, and 1.46-1.85x slower than the Gluon ones (docs/performance.md#the-atomic-dq-backward), so
# ``deterministic=False`` permits them but the choosers keep the faster, deterministic kernels.
# ``variant="atomic"`` / ``force(backward="atomic")`` still run them.
ATOMIC_BY_DEFAULT = False
# Head dims at which ``deterministic=False`` takes the one-pass Gluon backward whose dQ is added by
# TMA reduce-adds (``ONE_PASS_ATOMIC``, docs/hopper.md#atomic-dq-in-one-pass) in place of ``dkdv`` /
# ``dkdv_long``, from ``GLUON_ATOMIC_MIN_KEYS`` queries and keys (timed at Sq = Sk only): dense calls
# without a window that want all three gradients (its dQ workspace follows the dense walk). On the
# H100 it was 0-6% faster than ``dkdv_long`` from 8k keys and level (-2.5% to +1%) at 4k
# (docs/performance.md, The one-pass backward with TMA reduce-adds).
GLUON_ATOMIC_BACKWARD: frozenset[int] = frozenset({64})
GLUON_ATOMIC_MIN_KEYS = 8192
ONE_PASS_ATOMIC = "split_tma"


# The single-launch backward takes a GPU problem of at most this much work: batch x query heads x
# query rows x keys x head dim, counting only the keys a row sees under a causal mask (about half).
# It pays where the backward's host time (three launches and their buffers against one) is longer
# than what the three kernels save on the GPU: on the H100 (scripts/single_launch.py gpu) the single
# launch was ahead eagerly at every timed problem up to 2^31 and behind from 2^33; at 2^32 ahead at
# head dim 64 and 5% behind at 128 (docs/performance.md#one-launch-for-a-short-backward).
SINGLE_MAX_WORK = 1 << 31


def single_launch_suits(*, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                        causal: bool, device) -> bool:
    """Whether an unforced backward on ``device`` takes the single-launch backward, before any other
    rule (``backward_variant``, atomics): never on the CPU interpreter (the CPU suite tests it forced,
    the three launches by default). Packed sequences ask with batch 1, every row against the longest
    key sequence."""
    if device.type != "cuda":
        return False
    work = batch * heads_q * seqlen_q * seqlen_k * head_dim
    return (work // 2 if causal else work) <= SINGLE_MAX_WORK


def backward_candidates(head_dim: int, one_pass: bool = True) -> tuple[str, ...]:
    """Every variant ``backward_variant`` can take at this head dim (the GPU tests force each);
    ``one_pass=False``: those it can take on a window or packed sequences (no one-pass variant)."""
    fused = (ONE_PASS_ATOMIC,) if one_pass and head_dim in GLUON_ATOMIC_BACKWARD else ()
    return HOPPER_BACKWARD_VARIANTS.get(head_dim, ()) + fused


def backward_variant(*, head_dim: int, dtype, device, causal: bool, seqlen_q: int, seqlen_k: int,
                     deterministic: bool = True, one_pass: bool = True) -> str:
    """The backward's kernels above the single launch's sizes (``single_launch_suits``, asked first):
    a Gluon variant, ``"triton"`` or ``"atomic"``. ``dkdv`` (dK and dV on the
    Gluon kernel; dQ on the Gluon dQ kernel at head dim 128, on the Triton one at 64) at head dims 64
    and 128; at 64 from ``GLUON_DQ_MIN_KEYS_D64`` keys ``dkdv_long`` (dQ on the Gluon kernel too).
    Where ``deterministic`` is False, ``one_pass`` (a dense call without a window that wants all
    three gradients), the head dim is in ``GLUON_ATOMIC_BACKWARD`` and there are
    ``GLUON_ATOMIC_MIN_KEYS`` queries and keys, on a Triton whose Gluon has the TMA reduce-add it is
    built on: ``ONE_PASS_ATOMIC`` (not deterministic). Elsewhere the Triton kernels
    (``_portable_backward``). Measurements: docs/performance.md."""
    if not configs.gluon_hopper_applies(head_dim=head_dim, dtype=dtype, device=device):
        return _portable_backward(None, deterministic)
    # Hopper (sm_90, fp16/bf16, head dim 64/128): the Gluon kernels, on the H100 1.46-1.85x faster
    # than the portable atomic ones; deterministic, except the one-pass form deterministic=False takes.
    if (not deterministic and one_pass and head_dim in GLUON_ATOMIC_BACKWARD
            and min(seqlen_q, seqlen_k) >= GLUON_ATOMIC_MIN_KEYS and configs.gluon_tma_reduce_available()):
        return ONE_PASS_ATOMIC
    if head_dim == 64 and seqlen_k >= GLUON_DQ_MIN_KEYS_D64:
        return "dkdv_long"
    return "dkdv"


def _portable_backward(variant: str | None, deterministic: bool) -> str:
    """``"triton"`` or ``"atomic"`` for a call that runs on the portable kernels (packed sequences,
    windows, score variants the Gluon kernels do not take, explicit configs, or a Gluon variant its
    inputs do not allow): a forced
    ``"atomic"`` or ``"triton"`` as given, else ``"triton"``, or ``"atomic"`` where ``deterministic``
    is False and ``ATOMIC_BY_DEFAULT`` (a forced Gluon variant that cannot run falls back to
    ``"triton"``: deterministic). A forced variant wins over ``deterministic``: forcing is for tests
    and benchmarks."""
    if variant is None:
        return ATOMIC if ATOMIC_BY_DEFAULT and not deterministic else TRITON
    return ATOMIC if variant == ATOMIC else TRITON


@on_input_device
def backward(dout, q, k, v, out, lse, sm_scale: float, causal: bool, *, dlse=None,
             dq=None, dk=None, dv=None, need_dq=True, need_dkdv=True,
             config: tuple[BwdConfig, BwdConfig] | None = None, variant: str | None = None,
             varlen: Varlen | None = None, window: tuple[int, int] | None = None,
             scores: ScoreVariant = PLAIN, dsink: torch.Tensor | None = None, deterministic: bool = True):
    """Gradients of attention on validated [B, S, H, D] views (last stride 1): (dq, dk, dv), None for
    those not requested (need_dq, need_dkdv). out / lse are what the forward returned; dlse
    (optional, [B, Hq, Sq]) is a gradient on the LSE; dq / dk / dv may be preallocated views.
    ``config`` forces the Triton kernels with those tiles; ``variant`` as in the module docstring
    (a dK/dV-only Gluon variant takes dQ from the Gluon dQ kernel where
    ``backward_hopper.dq_on_gluon`` says so, else from the Triton one; ``"atomic"`` the Triton
    kernels with dQ added by the dK/dV kernel through atomics). ``deterministic=False`` lets the
    choice take the one-pass Gluon backward with atomic dQ (``backward_variant``'s ``ONE_PASS_ATOMIC``)
    and ``"atomic"`` where ``ATOMIC_BY_DEFAULT`` says it pays (nowhere yet); a forced variant wins, and
    a problem the single launch takes (``single_launch_suits``) is deterministic either way.
    ``varlen``: packed sequences (q / out / dout [total_q, Hq, D], k / v [total_k, Hkv, D], lse / dlse
    [Hq, total_q]); ``window`` as the forward's. Packed sequences run on the Triton kernels outside the
    head dims of ``GLUON_PACKED_BACKWARD`` unless a Gluon variant is forced (the dK/dV-only variants);
    windows and packed sequences run on them under the fused variants (``split``, ``split_atomic``,
    ``split_tma``), and score variants (``scores``, the forward's) outside ``GLUON_BACKWARD_SCORES``
    unless a Gluon variant is forced. With sinks,
    their gradient [Hq] float32 is written into ``dsink`` (allocated by the caller;
    ``backward.preprocess``)."""
    _check_backend(q, "backward")
    if scores.sinks is not None and dsink is None:
        raise ValueError("dsink: the backward with sinks writes their gradient into a [Hq] float32 tensor "
                         "the caller allocates; got None")
    max_q, max_k = (varlen.max_seqlen_q, varlen.max_seqlen_k) if varlen is not None else (q.shape[1], k.shape[1])
    causal, window = window_bounds(window, causal, max_q, max_k)
    dout = last_dim_contiguous(dout)
    dq = (dq if dq is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)) if need_dq else None
    if need_dkdv:
        dk = dk if dk is not None else torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = dv if dv is not None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    else:
        dk = dv = None
    head_dim = q.shape[-1]
    forced = variant or _forced_variant("backward")
    # A forced "single" is taken where it can run (below); elsewhere the rules decide, as unforced.
    forced_single = forced == SINGLE
    if forced_single:
        forced = None
    # dQ by atomics only where all three gradients are wanted (dQ alone: the dQ kernel does less work).
    portable_atomic = need_dq and need_dkdv and _portable_backward(forced, deterministic) == ATOMIC
    if varlen is not None:
        # Sizes for the single launch's rule: every row as if it saw the longest key sequence.
        batch, seqlen_q, heads_q, seqlen_k = 1, q.shape[0], q.shape[1], varlen.max_seqlen_k
    else:
        batch, seqlen_q, heads_q, _ = q.shape
        seqlen_k = k.shape[1]
    single = (config is None and need_dq and need_dkdv and scores.sinks is None
              and (forced_single or forced is None and single_launch_suits(
                  batch=batch, heads_q=heads_q, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
                  causal=causal, device=q.device)))
    hopper = None
    # The fused (one-pass) variants' dQ follows the dense causal walk: no window, no packed sequences.
    dense_walk = window is None and varlen is None
    if (config is None and not single and (varlen is None or head_dim in GLUON_PACKED_BACKWARD or forced is not None)
            and (forced not in (None, TRITON, ATOMIC) or gluon_takes(scores, GLUON_BACKWARD_SCORES, head_dim))):
        variant = forced or backward_variant(head_dim=head_dim, dtype=q.dtype, device=q.device, causal=causal,
                                             seqlen_q=max_q, seqlen_k=max_k, deterministic=deterministic,
                                             one_pass=dense_walk and need_dq and need_dkdv)
        if variant not in (TRITON, ATOMIC) and configs.gluon_available():
            from . import backward_hopper, sm90_common

            views = sm90_common.sequences(varlen, q, k, v, dout)[3]
            if backward_hopper.supported(*views, variant) and (
                    dense_walk or not backward_hopper.computes_dq(variant)):
                hopper = variant
    if varlen is not None and (hopper is None or q.shape[0] == 0 or k.shape[0] == 0):
        if config is None:
            config = configs.backward_config(head_dim=head_dim, dtype=q.dtype, device=q.device)
        triton_backward.run_varlen(dout, q, k, v, out, lse, sm_scale, causal, dlse, dq, dk, dv, config, varlen,
                                   window, scores, dsink, atomic=portable_atomic and not single, single=single)
        return dq, dk, dv
    if seqlen_q == 0 or seqlen_k == 0 or batch == 0 or heads_q == 0:
        for t in (dq, dk, dv):            # no score exists, so every gradient is zero
            if t is not None:
                t.zero_()
        if scores.sinks is not None:      # rows with no key still have lse = sink
            if seqlen_q == 0 or batch == 0 or heads_q == 0:
                dsink.zero_()
            else:
                triton_backward.preprocess(dout, out, lse, dlse, seqlen_q, False, sinks=scores.sinks, dsink=dsink)
        return dq, dk, dv

    if single:
        triton_backward.run_single(dout, q, k, v, out, lse, dlse, dq, dk, dv, sm_scale, causal,
                                   configs.backward_config(head_dim=head_dim, dtype=q.dtype, device=q.device),
                                   window, scores)
        return dq, dk, dv

    atomic = hopper is None and portable_atomic
    if config is None:
        config = configs.backward_config(head_dim=head_dim, dtype=q.dtype, device=q.device)
    dkdv_cfg, dq_cfg = config
    # fp32 gradients are compared with fp32 PyTorch: recompute P without the base-2 round trip.
    precise_p = q.dtype == torch.float32
    if varlen is not None:
        # Packed sequences on the Gluon kernels: the stats of the packed rows, [1, Hq, total_q] padded to
        # TMA's alignment (the kernels mask a tile's rows past its sequence's end).
        delta, lse2 = triton_backward.preprocess(dout[None], out[None], lse[None],
                                                 dlse[None] if dlse is not None else None,
                                                 backward_hopper.padded_rows(seqlen_q, packed=True), False,
                                                 None, scores.sinks, dsink)
        if need_dkdv:
            backward_hopper.backward_hopper(dout, q, k, v, lse2, delta, sm_scale, causal, None, dk, dv,
                                            variant=hopper, scores=scores, window=window, varlen=varlen)
        if need_dq and backward_hopper.dq_on_gluon(hopper, head_dim):
            backward_hopper.dq_hopper(dout, q, k, v, lse2, delta, sm_scale, causal, dq, variant=hopper,
                                      scores=scores, window=window, varlen=varlen)
        elif need_dq:
            triton_backward.run_dq_varlen(q, k, v, dout, lse2, delta, dq, sm_scale, causal, dq_cfg, varlen, window,
                                          scores)
        return dq, dk, dv
    # The Hopper kernel reads delta and lse2 in whole tiles: their rows are padded to a tile multiple.
    rows = backward_hopper.padded_rows(seqlen_q) if hopper is not None else seqlen_q
    dq_accum = triton_backward.dq_accumulator(q, rows) if atomic else None
    delta, lse2 = triton_backward.preprocess(dout, out, lse, dlse, rows, precise_p, dq_accum, scores.sinks, dsink)
    if hopper is not None and backward_hopper.computes_dq(hopper):
        # The fused kernel computes all three gradients; unrequested ones go to scratch tensors.
        backward_hopper.backward_hopper(
            dout, q, k, v, lse2, delta, sm_scale, causal,
            dq if need_dq else torch.empty_like(q), dk if need_dkdv else torch.empty_like(k),
            dv if need_dkdv else torch.empty_like(v), variant=hopper, scores=scores)
        return dq, dk, dv
    if hopper is not None:
        if need_dkdv:
            backward_hopper.backward_hopper(dout, q, k, v, lse2, delta, sm_scale, causal, None, dk, dv,
                                            variant=hopper, scores=scores, window=window)
        if need_dq and backward_hopper.dq_on_gluon(hopper, head_dim):
            backward_hopper.dq_hopper(dout, q, k, v, lse2, delta, sm_scale, causal, dq, variant=hopper,
                                      scores=scores, window=window)
            need_dq = False
    elif need_dkdv:
        triton_backward.run_dkdv(q, k, v, dout, lse2, delta, dk, dv, sm_scale, causal, dkdv_cfg, rows, window,
                                 scores, dq_accum)
    if dq_accum is not None:
        triton_backward.convert_dq(dq_accum, dq, sm_scale)
    elif need_dq:
        triton_backward.run_dq(q, k, v, dout, lse2, delta, dq, sm_scale, causal, dq_cfg, rows, window, scores)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------------

# Windows and score variants on the Gluon decode kernel where the chooser takes it (off: the Triton
# kernel for them). Timed against the Triton kernel: docs/performance.md#decode-with-windows-and-score-variants.
GLUON_DECODE_VARIANTS = True


@on_input_device
def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           cache_seqlens: torch.Tensor | None, block_table: torch.Tensor | None, seqlen_new: int,
           max_seqlen: int, sm_scale: float, causal: bool, num_splits: int = 0,
           config: DecodeConfig | None = None, window: tuple[int, int] | None = None,
           scores: ScoreVariant = PLAIN):
    """Decode attention on validated inputs (last stride 1 everywhere, the cache already appended
    to): (out [B, Sq, Hq, D] in q's dtype, lse [B, Hq, Sq] float32 natural log).

    q [B, Sq, Hq, D]; k_cache / v_cache [B, S_max, Hkv, D], or [num_pages, page_size, Hkv, D] with
    block_table [B, max_pages] int32; cache_seqlens [B] int32 or None (every sequence S_max long).
    Sequence b attends to cache_seqlens[b] + seqlen_new keys; ``max_seqlen`` bounds that number (the
    split count follows it). ``num_splits`` 0 = choose; ``config`` overrides the chooser entirely.
    ``window``: (left, right) as the forward's; ``scores``: the score variants, as the forward's (both
    kernels take them). A sink is added once: in the kernel's epilogue with one split, in the merge
    (as one more part with no value) with several.
    """
    _check_backend(q, "decode")
    causal, window = window_bounds(window, causal, q.shape[1], max_seqlen)
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    paged = block_table is not None
    chosen = config is None
    if chosen:
        def gluon_suits():
            if not configs.gluon_available() or ((window is not None or scores.any) and not GLUON_DECODE_VARIANTS):
                return False
            from . import decode_hopper
            return decode_hopper.supported(q, k_cache, v_cache, block_table)

        if window is not None and window[0] >= 0:
            # The keys some row's window holds: at most left + seqlen_q (+ right) of them.
            max_seqlen = min(max_seqlen, window[0] + seqlen_q + max(window[1], 0))
        config = configs.decode_config(head_dim=head_dim, dtype=q.dtype, rows=heads_q // heads_kv * seqlen_q,
                                       batch=batch, heads_kv=heads_kv, max_seqlen=max_seqlen,
                                       num_splits=num_splits, paged=paged, device=q.device,
                                       page_size=k_cache.shape[1] if paged else None,
                                       gluon_suits=gluon_suits if q.is_cuda else None)
    splits = config.num_splits
    if splits == 1:
        o_part, l_part = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        o_part, l_part = triton_decode.partials(q, splits)

    if config.kernel == "gluon":
        from . import decode_hopper
        # The chooser takes it only where gluon_suits() held; a config the caller gave is checked.
        if not chosen and not decode_hopper.supported(q, k_cache, v_cache, block_table):
            raise ValueError("DecodeConfig(kernel='gluon') takes fp16/bf16 inputs on an sm_90 GPU, head_dim "
                             "64 or 128, TMA-compatible caches and (paged) a power-of-two page size of at "
                             f"least {decode_hopper.MIN_BOX}; got "
                             f"q {q.dtype} {tuple(q.shape)} "
                             f"on {q.device}, k_cache {tuple(k_cache.shape)} strides {k_cache.stride()}")
        decode_hopper.decode_hopper(q, k_cache, v_cache, o_part, l_part, cache_seqlens, block_table,
                                    seqlen_new, sm_scale, causal, block_n=config.block_n,
                                    stages=config.num_stages, num_splits=splits, window=window, scores=scores)
    else:
        triton_decode.run(q, k_cache, v_cache, o_part, l_part, cache_seqlens, block_table, seqlen_new,
                          sm_scale, causal, config, window, scores)
    if splits > 1:
        merge(o_part, l_part, out=out, lse=lse, sinks=scores.sinks)
    return out, lse


# --------------------------------------------------------------------------------------------------
# Merge
# --------------------------------------------------------------------------------------------------

def merge(out_partials: torch.Tensor, lse_partials: torch.Tensor, **kwargs):
    """merge_attn_states' kernel (``merge.merge``: one kernel, nothing to choose but the backend)."""
    _check_backend(out_partials, "merge")
    return triton_merge.merge(out_partials, lse_partials, **kwargs)

"""Public entry points: validation, layouts, dispatch.

Two layouts, one kernel:

* ``flash_attn_func``: FlashAttention's [batch, seqlen, heads, head_dim].
* ``attention``: the seeds' (and SDPA's) [batch, heads, seqlen, head_dim].

and packed sequences of different lengths, ``flash_attn_varlen_func`` ([total, heads, head_dim] with
cu_seqlens offsets, FlashAttention's varlen layout), on the same Triton kernels.

Both go through ``triflash.autograd``: the custom op where torch.compile, tracing or a dispatch mode
must see one, an autograd.Function for eager autograd, and the bare implementation for an eager call
that records no graph; all three run the same implementation, which hands [B, S, H, D] *views* (no
copies) to the kernel launchers; the kernels read every tensor through its strides. Only a tensor whose
last dimension is not contiguous is copied. Both functions are differentiable in q, k, v (and through
the returned lse) and work under torch.compile.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from . import autograd as _autograd
from .kernels import configs, launch
from .kernels.common import Varlen
from .kernels.common import last_dim_contiguous as _last_dim_contiguous

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256

_LAYOUTS = {
    # layout name -> (dim names in order, index of seqlen, index of heads)
    "bshd": ("[batch, seqlen, heads, head_dim]", 1, 2),
    "bhsd": ("[batch, heads, seqlen, head_dim]", 2, 1),
}


class _Shape(NamedTuple):
    batch: int
    seqlen: int
    heads: int
    head_dim: int


def _dims(t: torch.Tensor, layout: str) -> _Shape:
    _, s_dim, h_dim = _LAYOUTS[layout]
    return _Shape(t.shape[0], t.shape[s_dim], t.shape[h_dim], t.shape[3])


# -- argument checks shared by every public entry point (here, and kvcache.py) ------------------

def _require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _require_rank(name: str, t: torch.Tensor, rank: int, doc: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {doc}, got {t.dim()}-D tensor of shape "
                         f"{tuple(t.shape)}")


def _require_float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}.dtype must be one of float16, bfloat16, float32, got {t.dtype}")


def _require_like_q(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    """Same dtype and device as q."""
    if t.dtype != q.dtype:
        raise TypeError(f"{name}.dtype must match q.dtype ({q.dtype}), got {t.dtype}")
    _require_same_device(name, t, q)


def _require_same_device(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    if t.device != q.device:
        raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")


def _type_name(value) -> str:
    """The type's name, with its module when it is not a builtin (numpy.bool, not a bare "bool")."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def _require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {_type_name(value)}")


def _check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")


def _check_heads(heads_q: int, heads_kv: int) -> None:
    if heads_q == 0 and heads_kv == 0:
        return                            # no heads at all: an empty result, as in SDPA
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"the number of query heads must be a multiple of the number of key/value "
                         f"heads (GQA/MQA): expected Hq % Hkv == 0, got Hq={heads_q}, Hkv={heads_kv}")


def _check_device(name: str, t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and configs.INTERPRET:
        return
    if t.device.type == "cpu":
        raise ValueError(
            f"{name} is on the CPU, but triflash needs a CUDA GPU (expected a tensor on 'cuda', got "
            f"device '{t.device}'). To run the kernels on the CPU through Triton's interpreter (slow, "
            f"for tests and learning), set TRITON_INTERPRET=1 before importing triton.")
    raise ValueError(f"{name} must be on a CUDA device, got device '{t.device}'")


# The kernels take the scale, and scale * log2(e), as float32: both must be normal float32 numbers (a
# scale that rounds to 0 or to inf there would turn every probability into 0 * inf = NaN).
_SCALE_RANGE = (2.0**-126, 2.0**127)


def _check_scale(softmax_scale, name: str, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {_type_name(softmax_scale)}")
    try:
        scale = float(softmax_scale)
    except OverflowError:
        scale = math.inf
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {softmax_scale!r}")
    if not _SCALE_RANGE[0] <= scale <= _SCALE_RANGE[1]:
        raise ValueError(f"{name} must be between 2^-126 and 2^127 (a normal float32 number, as the "
                         f"kernels use it), got {softmax_scale!r}")
    return scale


def _require_qkv(q, k, v, rank: int, q_doc: str, kv_doc: str, causal) -> None:
    """The checks every attention entry point starts with: tensors of ``rank`` dims, q's dtype one
    triflash computes, k and v like q, a device that runs the kernels, causal a bool."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_tensor(name, t)
    for name, t, doc in (("q", q, q_doc), ("k", k, kv_doc), ("v", v, kv_doc)):
        _require_rank(name, t, rank, doc)
    _require_float_dtype("q", q)
    for name, t in (("k", k), ("v", v)):
        _require_like_q(name, t, q)
    _check_device("q", q)
    _require_bool("causal", causal)


def _check_window(window_size, causal: bool) -> tuple[int, int]:
    """window_size as (left, right) ints >= -1 (-1: no bound on that side). With causal the right
    bound is 0: a right of -1 or 0 is accepted, any other raises (it would contradict causal)."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for no bound, got "
                        f"{window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1: no bound on that side), got {window_size!r}")
    if causal and right > 0:
        raise ValueError(f"window_size[1] must be -1 or 0 with causal=True (causal sees no later key), got "
                         f"{right}")
    return left, right


def validate_qkv(q, k, v, layout: str, scale_name: str = "softmax_scale", softmax_scale=None,
                 causal=False) -> float:
    """Check q/k/v for ``layout`` before any launch; return the softmax scale to use.

    Raises TypeError (wrong types or dtypes) or ValueError (shapes, devices, values), naming the
    argument with what was expected and what was received.
    """
    dims_doc = _LAYOUTS[layout][0]
    _require_qkv(q, k, v, 4, dims_doc, dims_doc, causal)

    qs, ks = _dims(q, layout), _dims(k, layout)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the same shape as k {tuple(k.shape)} {dims_doc}, got "
                         f"{tuple(v.shape)}")
    if ks.batch != qs.batch:
        raise ValueError(f"k and v batch size must equal q's ({qs.batch}), got {ks.batch}")
    if ks.head_dim != qs.head_dim:
        raise ValueError(f"k and v head_dim must equal q's head_dim ({qs.head_dim}), got {ks.head_dim}")
    _check_head_dim(qs.head_dim)
    _check_heads(qs.heads, ks.heads)
    return _check_scale(softmax_scale, scale_name, qs.head_dim)




# -- the call cache -------------------------------------------------------------------------------
#
# A call's validation and every choice the launchers make depend only on its tensors' metadata and its
# scalar arguments. So each entry point keys a call on those (``launch.meta``; scalars with their class, so
# that True never passes for 1.0 or (1, 0) for (True, 0)) and validates a key once: a key seen before
# is a valid call, and after two calls its launches replay from a plan (``kernels/launch.py``). A call
# whose key cannot be formed (a non-tensor where a tensor belongs, a list window) is validated every
# time, so every error still fires.

_NO_WINDOW = (-1, -1)
_DENSE = launch.cache()


def _window_key(window_size):
    return window_size if window_size is _NO_WINDOW else (window_size, tuple(map(type, window_size)))


def _check_dropout(dropout_p) -> None:
    """FlashAttention's ``dropout_p``, accepted for drop-in use: only 0 (triflash has no dropout)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a number (0.0: triflash has no dropout), got {_type_name(dropout_p)}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p must be 0.0: triflash has no attention dropout, got {dropout_p!r} (apply "
                         f"dropout outside the attention call, or use PyTorch's scaled_dot_product_attention)")


def _positional_options(name: str, options: str, extra: tuple) -> TypeError:
    """The error for options passed by position (see flash_attn_func's docstring)."""
    return TypeError(
        f"{name} takes q, k and v by position and every option by keyword ({options}), got "
        f"{len(extra)} more positional argument(s): {', '.join(_type_name(x) for x in extra)}. A positional "
        f"option is refused because the signatures differ: FlashAttention 2's fourth argument is dropout_p "
        f"where triflash's was softmax_scale, so a ported call would silently mean something else")


def _validate_dense(q, k, v, layout, scale_name, softmax_scale, causal, return_lse, window_size, dropout_p):
    scale = validate_qkv(q, k, v, layout, scale_name, softmax_scale, causal)
    _require_bool("return_lse", return_lse)
    _check_dropout(dropout_p)
    return scale, _check_window(window_size, causal)


def _dense(q, k, v, layout, scale_name, softmax_scale, causal, return_lse, window_size, dropout_p=0.0):
    """flash_attn_func and attention: validate (once per key), then the forward."""
    key = None
    if not torch.compiler.is_compiling():      # traced calls: no keys (data_ptr is opaque)
        try:
            key = (layout, launch.meta(q), launch.meta(k), launch.meta(v), softmax_scale, softmax_scale.__class__,
                   causal, causal.__class__, return_lse, return_lse.__class__, _window_key(window_size),
                   dropout_p, dropout_p.__class__)
        except (AttributeError, TypeError, RuntimeError):
            key = None
    entry = launch.lookup(_DENSE, key, _validate_dense, q, k, v, layout, scale_name, softmax_scale, causal,
                          return_lse, window_size, dropout_p)
    scale, window = entry.info
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    out, lse = _autograd.forward(q, k, v, scale, causal, layout == "bhsd", *window, entry=entry)
    return (out, lse) if return_lse else out


def flash_attn_func(q, k, v, *options, softmax_scale=None, causal=False, return_lse=False,
                    window_size=_NO_WINDOW, dropout_p=0.0):
    """Attention in FlashAttention's layout. Every argument after q, k, v is keyword-only (a
    positional one raises a TypeError: FlashAttention 2's fourth argument is dropout_p).

    Args:
        q: [batch, seqlen_q, heads_q, head_dim], float16 / bfloat16 / float32, on a CUDA device.
        k, v: [batch, seqlen_k, heads_kv, head_dim], same dtype and device. heads_q must be a multiple
            of heads_kv: each group of heads_q // heads_kv query heads shares one K/V head (GQA; MQA
            when heads_kv == 1).
        softmax_scale: multiplies q @ k^T before the softmax; default 1 / sqrt(head_dim).
        causal: mask keys after the query, aligned bottom-right: query i sees key j when
            j <= i + seqlen_k - seqlen_q. A query that sees no key gets out = 0 and lse = -inf.
        return_lse: also return the log-sum-exp of the scaled scores.
        window_size: (left, right), a local ("sliding") window, as in FlashAttention: query i sees
            key j when i + off - left <= j <= i + off + right, off = seqlen_k - seqlen_q; -1 leaves
            that side unbounded. With ``causal`` the right bound is 0 (a right of -1 or 0 is
            accepted). Windows run on the portable Triton kernels on every GPU.
        dropout_p: accepted for drop-in use with FlashAttention's keyword; only 0.0 (anything else
            raises: triflash has no dropout).

    Returns:
        out [batch, seqlen_q, heads_q, head_dim] in q's dtype; with ``return_lse``, (out, lse) where
        lse is [batch, heads_q, seqlen_q] float32, natural log.
    """
    if options:
        raise _positional_options("flash_attn_func", "softmax_scale=, causal=, return_lse=, window_size=, "
                                  "dropout_p=", options)
    return _dense(q, k, v, "bshd", "softmax_scale", softmax_scale, causal, return_lse, window_size, dropout_p)


def attention(q, k, v, *options, causal=False, sm_scale=None, return_lse=False, window_size=_NO_WINDOW):
    """Attention in the seeds' (and SDPA's) layout. Every argument after q, k, v is keyword-only.

    Args:
        q: [batch, heads_q, seqlen_q, head_dim]; k, v: [batch, heads_kv, seqlen_k, head_dim].
        causal, sm_scale, return_lse, window_size: as ``flash_attn_func``'s causal, softmax_scale,
            return_lse, window_size.

    Returns:
        out [batch, heads_q, seqlen_q, head_dim] (contiguous) in q's dtype; with ``return_lse``,
        (out, lse) with lse [batch, heads_q, seqlen_q] float32, natural log.
    """
    if options:
        raise _positional_options("attention", "causal=, sm_scale=, return_lse=, window_size=", options)
    return _dense(q, k, v, "bhsd", "sm_scale", sm_scale, causal, return_lse, window_size)


# -- packed variable-length batches ------------------------------------------------------------------

# Set to True to have flash_attn_varlen_func check the values of cu_seqlens_q / cu_seqlens_k on the
# host (starts at 0, non-decreasing, ends at the packed length, no sequence longer than max_seqlen):
# one small device->host synchronisation per call, skipped under torch.compile and while a CUDA graph
# is being captured (the values are not known there). Off by default, as in FlashAttention: bad
# offsets are then undefined behaviour.
CHECK_CU_SEQLENS = False
_VARLEN = launch.cache()

_PACKED_Q_DOC = "[total_q, heads_q, head_dim] (the sequences packed along dim 0)"
_PACKED_KV_DOC = "[total_k, heads_kv, head_dim] (the sequences packed along dim 0)"


def _require_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {_type_name(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_cu_seqlens(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, totals: tuple[int, int],
                      max_seqlens: tuple[int, int]) -> None:
    """The offsets' values: each starts at 0, never decreases, ends at its packed length, and no
    sequence is longer than its max_seqlen. A few numbers per tensor reach the host in one copy; only
    a failed check looks further (for the message)."""
    names = ("cu_seqlens_q", "cu_seqlens_k")
    offsets = [cu.long() for cu in (cu_seqlens_q, cu_seqlens_k)]     # int32 differences could wrap
    lengths = [cu[1:] - cu[:-1] for cu in offsets]
    stats = []
    for cu, n in zip(offsets, lengths):
        none = cu.new_zeros(())
        stats += [cu[0], cu[-1], n.min() if n.numel() else none, n.max() if n.numel() else none]
    stats = torch.stack(stats).tolist()                                   # the one sync
    for i, (name, cu, n) in enumerate(zip(names, offsets, lengths)):
        first, last, shortest, longest = stats[4 * i: 4 * i + 4]
        max_name = "max_seqlen_" + name[-1]
        if first != 0:
            raise ValueError(f"{name}[0] must be 0 (the first sequence starts at row 0), got {first}")
        if shortest < 0:
            b = int(torch.argmin(n))
            raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0), got {name}[{b}] = "
                             f"{int(cu[b])} > {name}[{b + 1}] = {int(cu[b + 1])}")
        if last != totals[i]:
            raise ValueError(f"{name}[-1] must equal the packed length ({totals[i]} rows), got {last}")
        if longest > max_seqlens[i]:
            b = int(torch.argmax(n))
            raise ValueError(f"{max_name} must be >= every sequence's length, got {max_name} = "
                             f"{max_seqlens[i]} and sequence {b} of length {longest} ({name}[{b + 1}] - "
                             f"{name}[{b}])")


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal) -> tuple[float, int, int]:
    """Check flash_attn_varlen_func's arguments before any launch, all but the offsets' values
    (``check_cu_seqlens_values``); return (scale, max_seqlen_q, max_seqlen_k). Raises TypeError /
    ValueError naming the argument, as ``validate_qkv``."""
    _require_qkv(q, k, v, 3, _PACKED_Q_DOC, _PACKED_KV_DOC, causal)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the same shape as k {tuple(k.shape)} {_PACKED_KV_DOC}, got "
                         f"{tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k and v head_dim must equal q's head_dim ({q.shape[2]}), got {k.shape[2]}")
    _check_head_dim(q.shape[2])
    _check_heads(q.shape[1], k.shape[1])
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _require_tensor(name, cu)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name}.dtype must be torch.int32, got {cu.dtype}")
        _require_rank(name, cu, 1, "[batch + 1] (each sequence's first row, then the packed length)")
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must have batch + 1 >= 1 entries, got 0")
        _require_same_device(name, cu, q)
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_k must have as many entries as cu_seqlens_q (batch + 1 = "
                         f"{cu_seqlens_q.shape[0]}), got {cu_seqlens_k.shape[0]}")
    max_seqlen_q = _require_int("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _require_int("max_seqlen_k", max_seqlen_k)
    scale = _check_scale(softmax_scale, "softmax_scale", q.shape[2])
    # No sequence is longer than the packed total: a larger bound would only launch idle programs
    # (or, far larger, a grid past CUDA's limit), so it is cut to the total.
    return scale, min(max_seqlen_q, q.shape[0]), min(max_seqlen_k, k.shape[0])


def check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """The offsets' values, where ``CHECK_CU_SEQLENS`` asks for them and they can be read."""
    if (CHECK_CU_SEQLENS and not torch.compiler.is_compiling()
            and type(cu_seqlens_q) is torch.Tensor and type(cu_seqlens_k) is torch.Tensor
            and not (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
        _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, (q.shape[0], k.shape[0]), (max_seqlen_q, max_seqlen_k))


def _validate_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                          causal, return_lse, window_size, dropout_p):
    """Everything flash_attn_varlen_func checks that its key decides (the offsets' values aside)."""
    checked = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                              causal)
    _require_bool("return_lse", return_lse)
    _check_dropout(dropout_p)
    return checked, _check_window(window_size, causal)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           softmax_scale=None, causal=False, window_size=_NO_WINDOW, return_lse=False,
                           dropout_p=0.0):
    """Attention over a batch of sequences of different lengths, packed without padding
    (FlashAttention's varlen layout and argument names).

    Args:
        q: [total_q, heads_q, head_dim]: every sequence's queries, one after another.
        k, v: [total_k, heads_kv, head_dim], packed the same way; dtype and device as q. GQA / MQA as
            in ``flash_attn_func``.
        cu_seqlens_q, cu_seqlens_k: [batch + 1] int32 on q's device: sequence b owns rows
            cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and cu_seqlens_k[b] ..
            cu_seqlens_k[b + 1] - 1 of k and v. They start at 0, never decrease, and end at total_q /
            total_k. A sequence may be empty (no queries, or no keys: its rows get out = 0).
        max_seqlen_q, max_seqlen_k: ints at least as large as the longest sequence (they size the
            launch; larger only costs idle programs).
        softmax_scale, causal, window_size, return_lse, dropout_p: as ``flash_attn_func`` (the window applies
            within each sequence), keyword only (FlashAttention 2 has
            dropout_p in the eighth place, FlashAttention 3 seqused_q: a call ported with positional
            arguments raises instead of taking one for the other). Causal is aligned bottom-right
            within each sequence: its query i sees its key j when j <= i + seqlen_k - seqlen_q.

    Returns:
        out [total_q, heads_q, head_dim] in q's dtype; with ``return_lse``, (out, lse) where lse is
        [heads_q, total_q] float32, natural log (-inf for a row that sees no key).

    Differentiable in q, k and v, and usable under torch.compile (not under torch.func transforms).
    The call does not synchronise with the GPU: the offsets' values are not read (as in
    FlashAttention), and offsets that break these rules are undefined behaviour (rows past a
    too-small max_seqlen are never written). ``triflash.api.CHECK_CU_SEQLENS = True`` checks them on
    the host on every call (one synchronisation; skipped under torch.compile and CUDA graph
    capture). The Triton kernel runs every GPU (on Hopper, not
    yet the Gluon fast path of ``flash_attn_func``).
    """
    key = None
    if not torch.compiler.is_compiling():      # traced calls: no keys (data_ptr is opaque)
        try:
            key = (launch.meta(q), launch.meta(k), launch.meta(v), launch.meta(cu_seqlens_q),
                   launch.meta(cu_seqlens_k), max_seqlen_q, max_seqlen_q.__class__, max_seqlen_k,
                   max_seqlen_k.__class__, softmax_scale, softmax_scale.__class__, causal, causal.__class__,
                   return_lse, return_lse.__class__, _window_key(window_size), dropout_p, dropout_p.__class__)
        except (AttributeError, TypeError, RuntimeError):
            key = None
    entry = launch.lookup(_VARLEN, key, _validate_varlen_call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, softmax_scale, causal, return_lse, window_size, dropout_p)
    (scale, max_q, max_k), window = entry.info
    check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    if cu_seqlens_q.stride(0) != 1 or cu_seqlens_k.stride(0) != 1:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_q, max_k)
    out, lse = _autograd.varlen_forward(q, k, v, varlen, scale, causal, window, entry=entry)
    return (out, lse) if return_lse else out

"""Public entry points: validation, layouts, dispatch.

Two layouts, one kernel:

* ``flash_attn_func``: FlashAttention's [batch, seqlen, heads, head_dim].
* ``attention``: the seeds' (and SDPA's) [batch, heads, seqlen, head_dim].

and packed sequences of different lengths, ``flash_attn_varlen_func`` ([total, heads, head_dim] with
cu_seqlens offsets, FlashAttention's varlen layout), on the same kernels (``kernels.dispatch`` picks).

Both go through ``triflash.autograd``: the custom op where torch.compile, tracing or a dispatch mode
must see one, an autograd.Function for eager autograd, and the bare implementation for an eager call
that records no graph; all three run the same implementation, which hands [B, S, H, D] *views* (no
copies) to the kernel launchers; the kernels read every tensor through its strides. Only a tensor whose
last dimension is not contiguous is copied. Both functions are differentiable in q, k, v (and through
the returned lse) and work under torch.compile.
"""

from __future__ import annotations

import torch

from . import autograd as _autograd
from .kernels import launch
from .kernels.common import Varlen, unit_stride
from .kernels.common import last_dim_contiguous as _last_dim_contiguous
from .validation import (
    LAYOUTS,
    NO_WINDOW,
    check_dropout,
    check_head_dim,
    check_heads,
    check_scale,
    check_score_variants,
    check_window,
    dims,
    require_bool,
    require_int,
    require_qkv,
    require_rank,
    require_same_device,
    require_tensor,
    type_name,
    variant_key,
    window_key,
)

# The kernels take the scale, and scale * log2(e), as float32: both must be normal float32 numbers (a
# scale that rounds to 0 or to inf there would turn every probability into 0 * inf = NaN).


def validate_qkv(q, k, v, layout: str, scale_name: str = "softmax_scale", softmax_scale=None,
                 causal=False) -> float:
    """Check q/k/v for ``layout`` before any launch; return the softmax scale to use.

    Raises TypeError (wrong types or dtypes) or ValueError (shapes, devices, values), naming the
    argument with what was expected and what was received.
    """
    dims_doc = LAYOUTS[layout][0]
    require_qkv(q, k, v, 4, dims_doc, dims_doc, causal)

    qs, ks = dims(q, layout), dims(k, layout)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the same shape as k {tuple(k.shape)} {dims_doc}, got "
                         f"{tuple(v.shape)}")
    if ks.batch != qs.batch:
        raise ValueError(f"k and v batch size must equal q's ({qs.batch}), got {ks.batch}")
    if ks.head_dim != qs.head_dim:
        raise ValueError(f"k and v head_dim must equal q's head_dim ({qs.head_dim}), got {ks.head_dim}")
    check_head_dim(qs.head_dim)
    check_heads(qs.heads, ks.heads)
    return check_scale(softmax_scale, scale_name, qs.head_dim)


# -- the call cache -------------------------------------------------------------------------------
#
# A call's validation and every choice the launchers make depend only on its tensors' metadata and its
# scalar arguments. So each entry point keys a call on those (``launch.meta``; scalars with their class, so
# that True never passes for 1.0 or (1, 0) for (True, 0)) and validates a key once: a key seen before
# is a valid call, and after two calls its launches replay from a plan (``kernels/launch.py``). A call
# whose key cannot be formed (a non-tensor where a tensor belongs, a list window) is validated every
# time, so every error still fires.

_DENSE = launch.cache()


def _positional_options(name: str, options: str, extra: tuple) -> TypeError:
    """The error for options passed by position (see flash_attn_func's docstring)."""
    return TypeError(
        f"{name} takes q, k and v by position and every option by keyword ({options}), got "
        f"{len(extra)} more positional argument(s): {', '.join(type_name(x) for x in extra)}. A positional "
        f"option is refused because the signatures differ: FlashAttention 2's fourth argument is dropout_p "
        f"where triflash's was softmax_scale, so a ported call would silently mean something else")


def _validate_dense(q, k, v, layout, scale_name, softmax_scale, causal, return_lse, window_size, dropout_p,
                    softcap, alibi_slopes, sinks, deterministic):
    scale = validate_qkv(q, k, v, layout, scale_name, softmax_scale, causal)
    require_bool("return_lse", return_lse)
    require_bool("deterministic", deterministic)
    check_dropout(dropout_p)
    window = check_window(window_size, causal)
    qs = dims(q, layout)
    return scale, window, check_score_variants(softcap, alibi_slopes, sinks, q, qs.batch, qs.heads)


def dense_call(q, k, v, layout, scale_name, softmax_scale, causal, return_lse, window_size, dropout_p=0.0,
               softcap=0.0, alibi_slopes=None, sinks=None, deterministic=False):
    """flash_attn_func and attention (and integrations' SDPA signature): validate (once per call key),
    then the forward. ``layout`` is "bshd" or "bhsd"; ``scale_name`` names the scale argument in errors."""
    key = None
    if not torch.compiler.is_compiling():      # traced calls: no keys (data_ptr is opaque)
        try:
            variants = variant_key(softcap, alibi_slopes, sinks)
            key = None if variants is None else (
                layout, launch.meta(q), launch.meta(k), launch.meta(v), softmax_scale, softmax_scale.__class__,
                causal, causal.__class__, return_lse, return_lse.__class__, window_key(window_size),
                dropout_p, dropout_p.__class__, variants, deterministic, deterministic.__class__)
        except (AttributeError, TypeError, RuntimeError):
            key = None
    entry = launch.lookup(_DENSE, key, _validate_dense, q, k, v, layout, scale_name, softmax_scale, causal,
                          return_lse, window_size, dropout_p, softcap, alibi_slopes, sinks, deterministic)
    scale, window, softcap = entry.info
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    out, lse = _autograd.forward(q, k, v, scale, causal, layout == "bhsd", *window, softcap, alibi_slopes,
                                 unit_stride(sinks), deterministic, entry=entry)
    return (out, lse) if return_lse else out


def flash_attn_func(q, k, v, *options, softmax_scale=None, causal=False, return_lse=False,
                    window_size=NO_WINDOW, dropout_p=0.0, softcap=0.0, alibi_slopes=None, sinks=None,
                    deterministic=False):
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
            accepted). On H100/H200 at head dims 64 and 128 windows run on the Hopper kernels
            (the forward at 64 where a query sees at least 2048 keys, or a side is unbounded),
            elsewhere on the portable Triton kernels.
        dropout_p: accepted for drop-in use with FlashAttention's keyword; only 0.0 (anything else
            raises: triflash has no dropout).
        softcap: logit soft-capping (Gemma 2, Grok): when > 0 the scaled scores s = softmax_scale * q.k
            become softcap * tanh(s / softcap), before masking and softmax (FlashAttention's definition).
            0.0: none.
        alibi_slopes: ALiBi (BLOOM, MPT): float32 [heads_q] or [batch, heads_q]; the bias
            -slope * |i + seqlen_k - seqlen_q - j| is added to the (capped) score of query i and key j.
            Not differentiable (a tensor that requires grad raises while autograd records).
        sinks: attention sinks (gpt-oss): float32 [heads_q], one logit per query head that joins every
            row's softmax denominator with no value: out_i = sum_j e^{s_ij} v_j / (sum_j e^{s_ij} +
            e^{sink_h}). Differentiable (it trains). The returned lse includes the sink; a row that
            sees no key gets out = 0 and lse = sink.
            On H100/H200 (head dim 64/128) the variants run on the Hopper kernels, forward and
            backward, except softcap's forward and ALiBi's backward at head dim 64 (the portable
            Triton kernels, as fast there).
        deterministic: the backward gives bit-identical gradients from run to run (dQ summed in a
            fixed order). False (default) permits one that adds dQ's parts with atomics, whose order,
            and so dQ's last bits, vary between runs, where that is faster (on H100/H200: head dim 64,
            8k or more queries and keys, no window, not packed); ``torch.use_deterministic_algorithms
            (True)`` makes every backward deterministic whatever this says. The forward always is.

    Returns:
        out [batch, seqlen_q, heads_q, head_dim] in q's dtype; with ``return_lse``, (out, lse) where
        lse is [batch, heads_q, seqlen_q] float32, natural log.
    """
    if options:
        raise _positional_options("flash_attn_func", "softmax_scale=, causal=, return_lse=, window_size=, "
                                  "dropout_p=, softcap=, alibi_slopes=, sinks=, deterministic=", options)
    return dense_call(q, k, v, "bshd", "softmax_scale", softmax_scale, causal, return_lse, window_size, dropout_p,
                      softcap, alibi_slopes, sinks, deterministic)


def attention(q, k, v, *options, causal=False, sm_scale=None, return_lse=False, window_size=NO_WINDOW,
              softcap=0.0, alibi_slopes=None, sinks=None, deterministic=False):
    """Attention in the seeds' (and SDPA's) layout. Every argument after q, k, v is keyword-only.

    Args:
        q: [batch, heads_q, seqlen_q, head_dim]; k, v: [batch, heads_kv, seqlen_k, head_dim].
        causal, sm_scale, return_lse, window_size, softcap, alibi_slopes, sinks, deterministic: as
            ``flash_attn_func``'s causal, softmax_scale, return_lse, window_size, softcap, alibi_slopes,
            sinks, deterministic.

    Returns:
        out [batch, heads_q, seqlen_q, head_dim] (contiguous) in q's dtype; with ``return_lse``,
        (out, lse) with lse [batch, heads_q, seqlen_q] float32, natural log.
    """
    if options:
        raise _positional_options("attention", "causal=, sm_scale=, return_lse=, window_size=, softcap=, "
                                  "alibi_slopes=, sinks=, deterministic=", options)
    return dense_call(q, k, v, "bhsd", "sm_scale", sm_scale, causal, return_lse, window_size, 0.0, softcap,
                      alibi_slopes, sinks, deterministic)


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
    require_qkv(q, k, v, 3, _PACKED_Q_DOC, _PACKED_KV_DOC, causal)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the same shape as k {tuple(k.shape)} {_PACKED_KV_DOC}, got "
                         f"{tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k and v head_dim must equal q's head_dim ({q.shape[2]}), got {k.shape[2]}")
    check_head_dim(q.shape[2])
    check_heads(q.shape[1], k.shape[1])
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        require_tensor(name, cu)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name}.dtype must be torch.int32, got {cu.dtype}")
        require_rank(name, cu, 1, "[batch + 1] (each sequence's first row, then the packed length)")
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must have batch + 1 >= 1 entries, got 0")
        require_same_device(name, cu, q)
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_k must have as many entries as cu_seqlens_q (batch + 1 = "
                         f"{cu_seqlens_q.shape[0]}), got {cu_seqlens_k.shape[0]}")
    max_seqlen_q = require_int("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = require_int("max_seqlen_k", max_seqlen_k)
    scale = check_scale(softmax_scale, "softmax_scale", q.shape[2])
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
                          causal, return_lse, window_size, dropout_p, softcap, alibi_slopes, sinks, deterministic):
    """Everything flash_attn_varlen_func checks that its key decides (the offsets' values aside)."""
    checked = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                              causal)
    require_bool("return_lse", return_lse)
    require_bool("deterministic", deterministic)
    check_dropout(dropout_p)
    window = check_window(window_size, causal)
    return checked, window, check_score_variants(softcap, alibi_slopes, sinks, q, cu_seqlens_q.shape[0] - 1,
                                                 q.shape[1])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           softmax_scale=None, causal=False, window_size=NO_WINDOW, return_lse=False,
                           dropout_p=0.0, softcap=0.0, alibi_slopes=None, sinks=None, deterministic=False):
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
        softmax_scale, causal, window_size, return_lse, dropout_p, softcap, alibi_slopes, sinks,
            deterministic: as
            ``flash_attn_func`` (the window and ALiBi apply within each sequence, with its own lengths;
            [batch, heads_q] slopes are per sequence), keyword only (FlashAttention 2 has
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
    capture). On H100/H200 the Hopper kernels take packed sequences at head dim 128 (forward and
    backward) and the forward at 64 where ``flash_attn_func``'s rule would; elsewhere the Triton kernels.
    """
    key = None
    if not torch.compiler.is_compiling():      # traced calls: no keys (data_ptr is opaque)
        try:
            key = (launch.meta(q), launch.meta(k), launch.meta(v), launch.meta(cu_seqlens_q),
                   launch.meta(cu_seqlens_k), max_seqlen_q, max_seqlen_q.__class__, max_seqlen_k,
                   max_seqlen_k.__class__, softmax_scale, softmax_scale.__class__, causal, causal.__class__,
                   return_lse, return_lse.__class__, window_key(window_size), dropout_p, dropout_p.__class__,
                   deterministic, deterministic.__class__, variant_key(softcap, alibi_slopes, sinks))
            if key[-1] is None:
                key = None
        except (AttributeError, TypeError, RuntimeError):
            key = None
    entry = launch.lookup(_VARLEN, key, _validate_varlen_call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, softmax_scale, causal, return_lse, window_size, dropout_p, softcap,
                          alibi_slopes, sinks, deterministic)
    (scale, max_q, max_k), window, softcap = entry.info
    check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    if cu_seqlens_q.stride(0) != 1 or cu_seqlens_k.stride(0) != 1:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_q, max_k)
    out, lse = _autograd.varlen_forward(q, k, v, varlen, scale, causal, window, softcap, alibi_slopes,
                                        unit_stride(sinks), deterministic, entry=entry)
    return (out, lse) if return_lse else out

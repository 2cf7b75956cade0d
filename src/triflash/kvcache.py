"""Decode over a KV cache, and merging partial attention states: public functions and validation.

* ``flash_attn_with_kvcache``: FlashAttention's decode entry point (same argument names and
  semantics). A few query positions per sequence attend to that sequence's cached keys, optionally
  after appending new keys/values to the cache in place. Contiguous caches [B, S_max, Hkv, D] and
  paged caches [num_pages, page_size, Hkv, D] + block_table (any page size) are read in place.
  Split-KV (flash-decoding) spreads long sequences over many programs; ``merge_attn_states`` then
  combines the splits.
* ``merge_attn_states``: combine N partial attention results (out, lse) computed over disjoint key
  sets into the result over their union.

Both check every argument before any launch and raise TypeError (types, dtypes) or ValueError
(shapes, devices, values) naming the argument, with what was expected and what was received.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from .kernels import dispatch, launch
from .kernels.common import ScoreVariant, unit_stride
from .kernels.common import last_dim_contiguous as _last_dim_contiguous
from .validation import (
    check_device,
    check_head_dim,
    check_heads,
    check_scale,
    check_score_variants,
    check_window,
    require_bool,
    require_float_dtype,
    require_int,
    require_like_q,
    require_qkv,
    require_rank,
    require_same_device,
    require_tensor,
    variant_key,
    window_key,
)

# Set to True to have flash_attn_with_kvcache check the values of cache_seqlens (and the block-table
# entries they use) on the host: one small device->host synchronisation per call (skipped while a
# CUDA graph is being captured). Off by default, as in FlashAttention: lengths beyond the capacity or
# page indices out of range are then undefined behaviour.
CHECK_SEQLENS = False

_KVCACHE = launch.cache()
_MERGE = launch.cache()


class _Checked(NamedTuple):
    """What flash_attn_with_kvcache's validation resolved for one call key."""
    capacity: int
    num_pages: int
    page_size: int
    seqlens_from_int: int | None
    seqlen_new: int
    scale: float
    window: tuple[int, int]
    num_splits: int
    softcap: float


_Q_DOC = "[batch, seqlen_q, heads_q, head_dim]"
_CACHE_DOC = "[batch, seqlen_cache, heads_kv, head_dim]"
_PAGED_DOC = "[num_pages, page_size, heads_kv, head_dim]"
_NEW_DOC = "[batch, seqlen_new, heads_kv, head_dim]"


def _capturing_graph(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_lengths(cache_seqlens, block_table, seqlen_new, capacity, num_pages, page_size):
    """Check the lengths (and for paged caches the block-table entries they use) on the host: one
    device->host copy of three numbers. Returns the longest sequence (keys attended)."""
    lengths = cache_seqlens.long()
    total = lengths + seqlen_new
    stats = [lengths.min(), total.max()]
    if block_table is not None:
        pages_used = (total.clamp(min=0, max=capacity) + page_size - 1) // page_size        # [B]
        used = torch.arange(block_table.shape[1], device=block_table.device) < pages_used[:, None]
        bad = ((block_table < 0) | (block_table >= num_pages)) & used
        stats.append(bad.sum())
    stats = torch.stack(stats).tolist()                                    # the one sync
    if stats[0] < 0:
        b = int(torch.argmin(lengths))
        raise ValueError(f"cache_seqlens must be >= 0, got cache_seqlens[{b}] = {stats[0]}")
    if stats[1] > capacity:
        b = int(torch.argmax(total))
        where = (f"block_table.shape[1] * page_size = {block_table.shape[1]} * {page_size}"
                 if block_table is not None else "k_cache.shape[1]")
        raise ValueError(
            f"cache_seqlens[{b}] + seqlen_new must be <= the cache capacity ({where} = {capacity}), "
            f"got {stats[1] - seqlen_new} + {seqlen_new} = {stats[1]}")
    if block_table is not None and stats[2]:
        bad_at = torch.nonzero(bad)[0].tolist()
        raise ValueError(
            f"block_table entries used by the sequences must be page indices in [0, {num_pages}) "
            f"(k_cache.shape[0] pages), got block_table[{bad_at[0]}, {bad_at[1]}] = "
            f"{int(block_table[bad_at[0], bad_at[1]])} ({stats[2]} bad entries in use)")
    return stats[1]


def _require_no_grad(name, t):
    """Decode has no backward: refuse a tensor that autograd would expect a gradient through, rather
    than return a result that silently carries none."""
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but flash_attn_with_kvcache has no backward (it is for "
                         f"inference): expected a tensor without requires_grad; call it under "
                         f"torch.no_grad() or torch.inference_mode(), or pass {name}.detach()")


def _may_overlap(t) -> bool:
    """Whether two elements of ``t`` might share memory. PyTorch's own check answers yes, no, or "too
    hard" (any view with gaps, such as k and v unbound from one [..., 2, ...] tensor); for the last,
    a sufficient test: sorted by stride, each dimension's stride passes everything the smaller ones
    span (true of every view sliced or unbound from a dense tensor)."""
    status = torch._debug_has_internal_overlap(t)
    if status != 2:
        return status == 1
    span = 0
    for stride, size in sorted((abs(st), n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _check_writable_caches(k_cache, v_cache):
    """The append writes into the caches in place: each must be a tensor whose elements are its own
    (no expanded or overlapping view, which would make rows share memory and the last write win),
    and not the same memory as the other."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if _may_overlap(t):
            raise ValueError(f"{name} has elements that share memory (an expanded or overlapping view, "
                             f"strides {t.stride()}), so appending into it would write several rows to "
                             f"one place: expected a cache with its own memory per element")
    if k_cache.numel() and k_cache.data_ptr() == v_cache.data_ptr():
        raise ValueError("k_cache and v_cache are the same memory, so appending v would overwrite k: "
                         "expected two separate caches")


def _append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table):
    """Write k, v [B, Sn, Hkv, D] into the caches at positions cache_seqlens[b] + 0 .. Sn - 1 of each
    sequence (through the block table when paged), in place."""
    batch, seqlen_new = k.shape[:2]
    if seqlen_new == 0 or batch == 0:
        return
    device = k_cache.device
    pos = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=device)[None, :]   # [B, Sn]
    if block_table is None:
        rows = torch.arange(batch, device=device)[:, None].expand(batch, seqlen_new)
        slots = pos
    else:
        page_size = k_cache.shape[1]
        rows = torch.gather(block_table, 1, pos // page_size).long()                         # [B, Sn]
        slots = pos % page_size
    k_cache[rows, slots] = k
    v_cache[rows, slots] = v


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                            softmax_scale=None, causal=False, num_splits=0, return_lse=False, *,
                            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
    """Attention of a few new query positions per sequence against a KV cache (decode).

    Args:
        q: [batch, seqlen_q, heads_q, head_dim], float16 / bfloat16 / float32. seqlen_q is small: 1
            for plain decode, a few for speculative or chunked steps.
        k_cache, v_cache: the cache, same dtype and device as q, head_dim at most 256 and last
            dimension contiguous (it is read and written in place, never copied). Either
            contiguous, [batch, seqlen_cache, heads_kv, head_dim], or paged (when ``block_table``
            is given), [num_pages, page_size, heads_kv, head_dim] with any page_size >= 1.
            heads_q must be a multiple of heads_kv (GQA; MQA when heads_kv == 1).
        k, v: optional new keys/values [batch, seqlen_new, heads_kv, head_dim], given together. They
            are written into the cache, in place, at positions cache_seqlens[b] ..
            cache_seqlens[b] + seqlen_new - 1 of each sequence (through the block table when
            paged) before attending. ``cache_seqlens`` itself is not changed (as in FlashAttention:
            the caller advances it).
        cache_seqlens: [batch] int32 tensor (or a Python int for all sequences): the number of
            cached keys of each sequence before the append; 0 is allowed. Sequence b attends to
            cache_seqlens[b] + seqlen_new keys. None means every sequence fills the whole
            contiguous cache (seqlen_cache keys); required for paged caches and for appending.
        block_table: [batch, max_pages] int32: key j of sequence b lives in page
            block_table[b, j // page_size], slot j % page_size. Entries past a sequence's length
            are not read.
        softmax_scale: multiplies q @ k^T before the softmax; default 1 / sqrt(head_dim).
        causal: bottom-right aligned per sequence: with L_b keys, query i sees key j when
            j <= i + L_b - seqlen_q (the new queries are the last seqlen_q positions). With
            seqlen_q = 1 it changes nothing.
        num_splits: how many programs share one sequence's keys (split-KV, "flash-decoding"):
            0 = choose from batch, heads and length so that one wave of programs fills the GPU; 1 = no
            split (no merge pass); n > 1 = n, or fewer when n would leave some splits without keys
            (splits share the longest sequence's key blocks evenly, in whole blocks).
        return_lse: also return the log-sum-exp of the scaled scores.
        window_size: (left, right), a local window per sequence, as in ``flash_attn_func`` (query
            i sees key j when i + L_b - seqlen_q - left <= j <= i + L_b - seqlen_q + right; -1: no
            bound). Key blocks outside every row's window are not read.
        softcap, alibi_slopes, sinks: the score variants, as in ``flash_attn_func`` (ALiBi per
            sequence: key j of sequence b gets -slope * |i + L_b - seqlen_q - j|; [batch, heads_q]
            slopes are per sequence). Neither may require grad (decode has no backward). With
            split-KV the sink is added once, when the splits are merged (as one more part with no
            value); with one split, in the kernel's epilogue.

    Returns:
        out [batch, seqlen_q, heads_q, head_dim] in q's dtype; with ``return_lse``, (out, lse), lse
        [batch, heads_q, seqlen_q] float32, natural log. A query row that sees no key (a length of
        0, or causal rows before the sequence starts) gets out = 0 and lse = -inf.

    No call synchronises with the GPU. Everything the host knows (shapes, dtypes, devices, a Python
    int cache_seqlens) is checked; the values inside a cache_seqlens tensor and the block table are
    not read, as in FlashAttention: a length below 0 or past the capacity, or a page index out of
    range among the pages a sequence uses, is undefined behaviour (out-of-bounds reads). Setting
    ``triflash.kvcache.CHECK_SEQLENS = True`` checks them on every call (one small device->host
    read, skipped while a CUDA graph is captured), and then the split count follows the longest
    sequence instead of the capacity.
    """
    key = None
    if not torch.compiler.is_compiling():      # traced calls: no keys (data_ptr is opaque)
        try:
            key = (launch.meta(q), launch.meta(k_cache), launch.meta(v_cache),
                   None if k is None else launch.meta(k), None if v is None else launch.meta(v),
                   cache_seqlens if type(cache_seqlens) is int or cache_seqlens is None else launch.meta(cache_seqlens),
                   None if block_table is None else launch.meta(block_table), softmax_scale,
                   softmax_scale.__class__, causal, causal.__class__, num_splits, num_splits.__class__, return_lse,
                   return_lse.__class__, window_key(window_size), variant_key(softcap, alibi_slopes, sinks))
            if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad
                                            or (k is not None and (k.requires_grad or v.requires_grad))
                                            or (sinks is not None and sinks.requires_grad)):
                key = None                                 # validation refuses it, naming the tensor
            if key is not None and key[-1] is None:
                key = None
        except (AttributeError, TypeError, RuntimeError):
            key = None
    entry = launch.lookup(_KVCACHE, key, _validate, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                          softmax_scale, causal, num_splits, return_lse, window_size, softcap, alibi_slopes, sinks)
    checked = entry.info
    seqlen_new, capacity = checked.seqlen_new, checked.capacity
    seqlens_from_int = checked.seqlens_from_int
    if seqlens_from_int is not None:
        cache_seqlens = torch.full((q.shape[0],), seqlens_from_int, dtype=torch.int32, device=q.device)

    # -- the longest sequence, which sizes the split count (values: a device->host read, opt-in) --
    if cache_seqlens is None:
        max_seqlen = capacity
    elif seqlens_from_int is not None and block_table is None:
        max_seqlen = seqlens_from_int + seqlen_new
    elif q.shape[0] == 0 or not CHECK_SEQLENS or _capturing_graph(q.device):
        max_seqlen = capacity
    else:
        max_seqlen = _check_lengths(cache_seqlens, block_table, seqlen_new, capacity, checked.num_pages,
                                    checked.page_size)

    if k is not None:
        _check_writable_caches(k_cache, v_cache)
        _append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table)
    if q.stride(-1) != 1:
        q = _last_dim_contiguous(q)
    if entry.sub is None:
        entry.sub = {}
    plan = entry.sub.get(max_seqlen)
    if plan is None:
        plan = entry.sub[max_seqlen] = launch.Entry()
        plan.plan = entry.plan               # False where the key could not be kept
    sinks = unit_stride(sinks)
    out, lse = launch.call(plan, _decode_call, (q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, sinks),
                           seqlen_new, max_seqlen, checked.scale, causal, checked.num_splits, checked.window,
                           checked.softcap)
    return (out, lse) if return_lse else out


def _decode_call(q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, sinks, seqlen_new, max_seqlen,
                 scale, causal, num_splits, window, softcap):
    """``dispatch.decode`` with every tensor first (``launch.call``'s inputs)."""
    return dispatch.decode(q, k_cache, v_cache, cache_seqlens, block_table, seqlen_new, max_seqlen, scale, causal,
                           num_splits, None, window, ScoreVariant(softcap, alibi_slopes, sinks))


def _validate(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits,
              return_lse, window_size, softcap=0.0, alibi_slopes=None, sinks=None) -> _Checked:
    """Every check of flash_attn_with_kvcache that its arguments' metadata decides (not the values
    in cache_seqlens and block_table). Raises TypeError / ValueError naming the argument."""
    paged = block_table is not None
    cache_doc = _PAGED_DOC if paged else _CACHE_DOC
    require_qkv(q, k_cache, v_cache, 4, _Q_DOC, cache_doc, causal, kv_names=("k_cache", "v_cache"))
    require_bool("return_lse", return_lse)
    num_splits = require_int("num_splits", num_splits, 0)          # 0: choose automatically
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _require_no_grad(name, t)

    batch, seqlen_q, heads_q, head_dim = q.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have the same shape as k_cache {tuple(k_cache.shape)} "
                         f"{cache_doc}, got {tuple(v_cache.shape)}")
    heads_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache and v_cache head_dim must equal q's head_dim ({head_dim}), got "
                         f"{k_cache.shape[3]}")
    check_head_dim(head_dim)
    check_heads(heads_q, heads_kv)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 and head_dim > 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1, it is used in "
                             f"place and never copied), got strides {t.stride()}")

    # -- layout of the cache: contiguous or paged --
    if paged:
        require_tensor("block_table", block_table)
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table.dtype must be torch.int32, got {block_table.dtype}")
        require_rank("block_table", block_table, 2, "[batch, max_pages]")
        require_same_device("block_table", block_table, q)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table.shape[0] must equal q's batch size ({batch}), got "
                             f"{block_table.shape[0]}")
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        if num_pages == 0 or page_size == 0:
            raise ValueError(f"a paged k_cache {_PAGED_DOC} needs num_pages >= 1 and page_size >= 1, "
                             f"got shape {tuple(k_cache.shape)}")
        capacity = block_table.shape[1] * page_size
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required with a paged cache (block_table given), got None")
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache.shape[0] (batch) must equal q's batch size ({batch}), got "
                             f"{k_cache.shape[0]} (for a paged cache, pass block_table)")
        num_pages, page_size = 0, 0
        capacity = k_cache.shape[1]

    # -- cache_seqlens --
    seqlens_from_int = None            # a Python int: checked here, on the host, with no sync
    if cache_seqlens is not None:
        if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
            seqlens_from_int = int(cache_seqlens)
            if not -2**31 <= seqlens_from_int < 2**31:        # else torch.full fails unclearly
                raise ValueError(f"cache_seqlens must be >= 0 and <= the cache capacity ({capacity}), "
                                 f"got {seqlens_from_int}")
            if seqlens_from_int < 0:
                raise ValueError(f"cache_seqlens must be >= 0, got {seqlens_from_int}")
    if cache_seqlens is not None and seqlens_from_int is None:
        require_tensor("cache_seqlens", cache_seqlens)
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens.dtype must be torch.int32, got {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(f"cache_seqlens must have shape [batch] = ({batch},), got "
                             f"{tuple(cache_seqlens.shape)}")
        require_same_device("cache_seqlens", cache_seqlens, q)

    # -- new keys and values --
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        raise ValueError(f"k and v must be given together: got {given} but {missing} is None")
    seqlen_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            require_tensor(name, t)
            require_rank(name, t, 4, _NEW_DOC)
            require_like_q(name, t, q)
        if tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"v must have the same shape as k {tuple(k.shape)} {_NEW_DOC}, got "
                             f"{tuple(v.shape)}")
        expected = (batch, k.shape[1], heads_kv, head_dim)
        if tuple(k.shape) != expected:
            raise ValueError(f"k and v must be {_NEW_DOC} = (batch={batch}, seqlen_new, "
                             f"heads_kv={heads_kv}, head_dim={head_dim}), got {tuple(k.shape)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when k and v are appended (it says where "
                             "they go), got None")
        seqlen_new = k.shape[1]
        for name, t in (("k", k), ("v", v)):
            _require_no_grad(name, t)

    scale = check_scale(softmax_scale, "softmax_scale", head_dim)
    window = check_window(window_size, causal)
    if seqlens_from_int is not None and block_table is None and seqlens_from_int + seqlen_new > capacity:
        raise ValueError(f"cache_seqlens + seqlen_new must be <= the cache capacity (k_cache.shape[1] = "
                         f"{capacity}), got {seqlens_from_int} + {seqlen_new} = {seqlens_from_int + seqlen_new}")
    softcap = check_score_variants(softcap, alibi_slopes, sinks, q, batch, heads_q, "flash_attn_with_kvcache")
    return _Checked(capacity, num_pages, page_size, seqlens_from_int, seqlen_new, scale, window, num_splits,
                    softcap)


def merge_attn_states(out_partials, lse_partials):
    """Combine partial attention results over disjoint key sets into the result over their union.

    If part n attended to key set K_n and returned (out_n, lse_n), then for the keys K_1 u ... u K_N

        lse = log(sum_n exp(lse_n))          out = sum_n exp(lse_n - lse) * out_n

    Args:
        out_partials: [N, batch, seqlen, heads, head_dim], float16 / bfloat16 / float32
            (FlashAttention's layout for each part), or a list/tuple of N tensors [batch, seqlen,
            heads, head_dim] (stacked).
        lse_partials: [N, batch, heads, seqlen] float32, natural log: what
            ``flash_attn_func(..., return_lse=True)`` returns, stacked; or a list/tuple of N tensors
            [batch, heads, seqlen]. A part that saw no key has lse = -inf: it is ignored (its out is
            not read).

    Returns:
        (out [batch, seqlen, heads, head_dim] in out_partials' dtype, lse [batch, heads, seqlen]
        float32). A row whose parts all have lse = -inf gets out = 0 and lse = -inf.

    Parts computed with attention sinks (``sinks=``) each carry the sink in their lse, so merging
    them counts it once per part: the result is not the attention with sinks over the union. Merge
    parts computed without sinks instead (split-KV decode adds its sink once, after its merge).

    Differentiable in both inputs (for instance to train with attention computed in pieces, as ring
    attention does): the backward is a few PyTorch operations, d out_n = w_n dout and d lse_n =
    w_n (<dout, out_n - out> + dlse) with w_n = exp(lse_n - lse); an empty part gets zero gradients.
    """
    out_partials = _stack_parts("out_partials", out_partials, "[batch, seqlen, heads, head_dim]")
    lse_partials = _stack_parts("lse_partials", lse_partials, "[batch, heads, seqlen]")
    key = None
    if not torch.compiler.is_compiling():      # traced calls: no keys (data_ptr is opaque)
        try:
            key = (launch.meta(out_partials), launch.meta(lse_partials))
        except (AttributeError, TypeError, RuntimeError):
            key = None
    entry = launch.lookup(_MERGE, key, _validate_merge, out_partials, lse_partials)
    if torch.is_grad_enabled() and (out_partials.requires_grad or lse_partials.requires_grad):
        return _Merge.apply(out_partials, lse_partials, entry)
    return launch.call(entry, dispatch.merge, (_last_dim_contiguous(out_partials), lse_partials))


def _validate_merge(out_partials, lse_partials):
    """merge_attn_states' checks of the stacked partial states (their metadata decides them)."""
    require_rank("out_partials", out_partials, 5, "[N, batch, seqlen, heads, head_dim]")
    require_rank("lse_partials", lse_partials, 4, "[N, batch, heads, seqlen]")
    require_float_dtype("out_partials", out_partials)
    if lse_partials.dtype != torch.float32:
        raise TypeError(f"lse_partials.dtype must be torch.float32, got {lse_partials.dtype}")
    if lse_partials.device != out_partials.device:
        raise ValueError(f"lse_partials must be on the same device as out_partials "
                         f"({out_partials.device}), got {lse_partials.device}")
    check_device("out_partials", out_partials)
    n, batch, seqlen, heads, head_dim = out_partials.shape
    if n == 0:
        raise ValueError("out_partials must hold at least one partial state (N >= 1), got N = 0")
    if head_dim == 0:
        raise ValueError(f"out_partials head_dim must be >= 1, got shape {tuple(out_partials.shape)}")
    expected = (n, batch, heads, seqlen)
    if tuple(lse_partials.shape) != expected:
        raise ValueError(f"lse_partials must be [N, batch, heads, seqlen] = {expected} to match "
                         f"out_partials {tuple(out_partials.shape)}, got {tuple(lse_partials.shape)}")


class _Merge(torch.autograd.Function):
    """merge_attn_states with a gradient (see its docstring for the formulas)."""

    @staticmethod
    def forward(ctx, out_partials, lse_partials, entry=None):
        out, lse = launch.call(entry, dispatch.merge, (_last_dim_contiguous(out_partials), lse_partials))
        ctx.save_for_backward(out_partials, lse_partials, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        parts, lse_parts, lse = ctx.saved_tensors
        weights = torch.exp(lse_parts - torch.where(torch.isneginf(lse), 0.0, lse))     # [N, B, H, S]
        w = weights.permute(0, 1, 3, 2)[..., None]                                      # [N, B, S, H, 1]
        live = w > 0                          # an empty part's out is never read, not even here
        d_lse = torch.zeros_like(weights)
        d_parts = None
        if dout is not None:
            dout = dout.float()
            d_parts = torch.where(live, w * dout[None], 0.0).to(parts.dtype)
            parts32 = torch.where(live, parts.float(), 0.0)
            # out again, in float32: the returned one is rounded to the parts' dtype.
            diff = torch.where(live, parts32 - (w * parts32).sum(0, keepdim=True), 0.0)
            d_lse = d_lse + weights * (dout[None] * diff).sum(-1).permute(0, 1, 3, 2)
        if dlse is not None:
            d_lse = d_lse + weights * dlse[None]
        if d_parts is None and ctx.needs_input_grad[0]:
            d_parts = torch.zeros_like(parts)
        return (d_parts if ctx.needs_input_grad[0] else None,
                d_lse if ctx.needs_input_grad[1] else None, None)


def _stack_parts(name, parts, doc):
    """A list/tuple of per-part tensors (each ``doc``) becomes one stacked tensor."""
    if isinstance(parts, (list, tuple)):
        if len(parts) == 0:
            raise ValueError(f"{name} must hold at least one partial state, got an empty "
                             f"{type(parts).__name__}")
        for i, t in enumerate(parts):
            require_tensor(f"{name}[{i}]", t)
            if tuple(t.shape) != tuple(parts[0].shape) or t.dtype != parts[0].dtype:
                raise ValueError(f"{name}[{i}] must have the shape and dtype of {name}[0] "
                                 f"({tuple(parts[0].shape)}, {parts[0].dtype}), got "
                                 f"({tuple(t.shape)}, {t.dtype})")
            if t.device != parts[0].device:
                raise ValueError(f"{name}[{i}] must be on the device of {name}[0] "
                                 f"({parts[0].device}), got {t.device}")
            require_rank(f"{name}[{i}]", t, doc.count(",") + 1, doc)
        return torch.stack(list(parts))
    require_tensor(name, parts)
    return parts

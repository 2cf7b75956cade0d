"""triflash behind PyTorch's ``scaled_dot_product_attention`` and Hugging Face transformers' attention.

Many models (Hugging Face transformers' "sdpa" attention, torchtune, nanoGPT-style code) call
``torch.nn.functional.scaled_dot_product_attention``. Two ways to put triflash there:

* ``scaled_dot_product_attention(query, key, value, ...)``: SDPA's signature and semantics, for the
  calls triflash computes: no ``attn_mask``, no dropout, causal only with as many queries as keys
  (SDPA aligns its causal mask top-left, triflash bottom-right: the two agree only there). Anything
  else raises ``NotImplementedError`` naming the argument.
* ``sdpa_routed_to_triflash()``: a context manager that replaces
  ``torch.nn.functional.scaled_dot_product_attention`` while it is open. Calls triflash can compute go
  to it; every other call (a mask, dropout, top-left causal with Sq != Sk, an unsupported dtype or
  device, value's head dim differing from query's) goes to PyTorch's own function unchanged. The
  yielded ``counts`` say how many calls went each way and, for PyTorch, why (``counts["reasons"]``).

And one way to put triflash under Hugging Face transformers' models, without touching them:

* ``register_transformers()``: registers triflash with transformers' ``AttentionInterface`` (and its
  mask builder with ``AttentionMaskInterface``) under ``TRANSFORMERS_NAME``, so that
  ``AutoModelForCausalLM.from_pretrained(..., attn_implementation=TRANSFORMERS_NAME)`` runs its
  attention on triflash: causal and bidirectional, GQA, sliding windows, KV caches, padded batches
  (left or right padding, computed as one packed varlen call), logit soft-capping (Gemma 2) and
  attention sinks (gpt-oss's ``s_aux``). What triflash does not compute yet (dropout, masks other
  than causal / sliding-window / padding) runs in PyTorch for that call, counted by reason.
  docs/huggingface.md has the recipe.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch

from . import api, validation
from .reference import causal_visible

__all__ = ["TRANSFORMERS_COUNTS", "TRANSFORMERS_NAME", "CallCounts", "register_transformers",
           "scaled_dot_product_attention", "sdpa_routed_to_triflash", "transformers_attention"]


class CallCounts(dict):
    """Where calls went: ``{"triflash": n, "torch": m, "reasons": {reason: count}}``, the reasons
    being why each PyTorch call could not go to triflash (short, stable phrases such as
    ``"attn_mask"`` or ``"softcap"``; see docs/huggingface.md for the list). A plain dict otherwise;
    ``reset()`` zeroes it."""

    def __init__(self):
        super().__init__(triflash=0, torch=0, reasons={})

    def to_triflash(self) -> None:
        self["triflash"] += 1

    def to_torch(self, reason: str) -> None:
        self["torch"] += 1
        self["reasons"][reason] = self["reasons"].get(reason, 0) + 1

    def reset(self) -> None:
        self.update(triflash=0, torch=0, reasons={})


def _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """((reason, message), None) when triflash cannot compute this SDPA call exactly as PyTorch
    would, else (None, run): ``run()`` computes it. ``reason`` is a short stable phrase (what the
    router counts), ``message`` says it in full (what the drop-in raises). The checks SDPA's
    semantics add come first; then the inputs, folded to [N, H, S, E], go through
    triflash.attention's own validation (``api.validate_qkv``: dtypes, devices, head dims, heads,
    scale), whose message becomes the reason's message."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return ("not tensors", "query, key and value must be tensors"), None
    if attn_mask is not None:
        return ("attn_mask", "attn_mask is not supported (only None); use is_causal for a causal mask"), None
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        return ("dropout_p", f"dropout_p must be 0.0 (triflash has no dropout), got {dropout_p!r}"), None
    if not isinstance(is_causal, bool):
        return ("is_causal not a bool", f"is_causal must be a bool, got {type(is_causal).__name__}"), None
    if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
        return ("ranks", f"query, key and value must have the same rank, at least 3 ([..., L, E]), got "
                         f"{query.dim()}, {key.dim()} and {value.dim()}"), None
    if is_causal and query.shape[-2] != key.shape[-2]:
        return ("is_causal with L != S", f"is_causal with L != S (got L={query.shape[-2]}, S={key.shape[-2]}): SDPA "
                f"aligns its causal mask top-left, triflash bottom-right (use triflash.attention for that)"), None
    if key.shape[-2] == 0 and query.shape[-2] > 0:
        return ("no keys", "no keys (S = 0): PyTorch's softmax over nothing gives NaN, triflash 0"), None
    heads_at = 3 if query.dim() >= 4 else 2                  # 3-D inputs [N, L, E] have no head dim
    lead = query.shape[:-heads_at]
    if key.shape[:-heads_at] != lead or value.shape[:-heads_at] != lead:
        return ("batch dimensions", f"batch dimensions must match: query {tuple(query.shape)}, key "
                f"{tuple(key.shape)}, value {tuple(value.shape)}"), None
    hq, hk = (query.shape[-3], key.shape[-3]) if query.dim() >= 4 else (1, 1)
    if hq != hk and not enable_gqa:
        return ("heads differ without enable_gqa",
                f"query has {hq} heads and key/value {hk}: that needs enable_gqa=True (as in SDPA)"), None
    batch = math.prod(lead)                               # (not -1: any dimension may be 0)
    q4, k4, v4 = (t.unsqueeze(1) if t.dim() == 3 else t.reshape(batch, *t.shape[-3:]) for t in tensors)
    try:
        scale = api.validate_qkv(q4, k4, v4, "bhsd", "scale", scale, is_causal)
    except (TypeError, ValueError) as exc:
        # The reason names the argument only (triflash's messages start with it), so every call of one
        # kind counts under one key whatever its values.
        return (f"input triflash refuses: {str(exc).split(' ', 1)[0]}", str(exc)), None

    def run():
        # triflash.attention itself (its call cache: validated once per shape, launches replayed).
        out = api.dense_call(q4, k4, v4, "bhsd", "scale", scale, is_causal, False, validation.NO_WINDOW)
        return out.reshape(*lead, *out.shape[-3 if query.dim() >= 4 else -2:])
    return None, run


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` computed by triflash.

    query [..., Hq, L, E], key and value [..., Hkv, S, E] (SDPA's layout; 3-D inputs have one head).
    ``is_causal`` (with L == S), ``scale`` (default 1/sqrt(E)) and ``enable_gqa`` (Hq a multiple of
    Hkv) as in SDPA. Returns [..., Hq, L, E], differentiable like ``triflash.attention``.

    Raises NotImplementedError for what triflash does not compute (see the module docstring),
    before any launch.
    """
    why, run = _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if why is not None:
        raise NotImplementedError(f"triflash.integrations.scaled_dot_product_attention: {why[1]}")
    return run()


@contextlib.contextmanager
def sdpa_routed_to_triflash():
    """While open, ``torch.nn.functional.scaled_dot_product_attention`` runs triflash for the calls it
    supports and PyTorch's own function for the others. Yields a ``CallCounts`` dict counting the
    calls each way, and why each PyTorch call went there::

        {"triflash": 3, "torch": 2, "reasons": {"attn_mask": 1, "is_causal with L != S": 1}}

    so a model's coverage can be checked. The reasons: ``"attn_mask"``, ``"dropout_p"``,
    ``"is_causal with L != S"`` (SDPA's top-left causal), ``"heads differ without enable_gqa"``,
    ``"no keys"``, ``"batch dimensions"``, ``"ranks"``, ``"not tensors"``, ``"is_causal not a bool"``,
    and ``"input triflash refuses: <argument>"`` (a dtype, device, head dim or scale triflash does
    not take; the argument as triflash's error names it).

    Code that imported the function by name before the block (``from torch.nn.functional import
    scaled_dot_product_attention``) keeps PyTorch's.
    """
    original = torch.nn.functional.scaled_dot_product_attention
    counts = CallCounts()

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        why, run = _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if why is None:
            counts.to_triflash()
            return run()
        counts.to_torch(why[0])
        kwargs = {"enable_gqa": enable_gqa} if enable_gqa else {}
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = routed
    try:
        yield counts
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


# -- Hugging Face transformers ---------------------------------------------------------------------
#
# [Note: the name] transformers reads meaning into attn_implementation names: any name containing
# "flash" is taken for a FlashAttention build to import (a substring test, then a look for the
# flash-attn package or a Hub kernel of that name, which fails for "triflash"), and "sdpa", "flex",
# "eager", "paged" or a "/" select other paths. So the name carries none of them.
#
# [Note: masks] A model builds its mask once per forward through the AttentionMaskInterface entry of
# its attn_implementation, and hands the result to every layer's attention call. Without an entry,
# transformers builds no mask at all (padding would be silently ignored), so triflash registers one:
# ``_transformers_mask`` returns
#   * None: no padding, and the pattern (causal, sliding-window causal, bidirectional) is the
#     layer's own is_causal / sliding_window, which triflash computes directly;
#   * a [batch, n_keys] bool tensor, True for the real tokens among the layer's keys, when the batch
#     is padded on the left or on the right (or a static cache has unused slots past n_keys): the
#     attention call computes it as one varlen call over the padded tensors (``_padded``);
#   * transformers' own 4-D SDPA mask for anything else (packed sequences, chunked attention, image-token
#     overlays, padding with gaps), which the attention call hands to PyTorch, counting the reason.

TRANSFORMERS_NAME = "tri_attention"
"""The ``attn_implementation`` name ``register_transformers()`` registers by default."""

TRANSFORMERS_MIN_VERSION = "4.57"
_RESERVED_WORDS = ("flash", "sdpa", "flex", "eager", "paged", "/", ":", "@", "|")

TRANSFORMERS_COUNTS = CallCounts()
"""Every call of ``transformers_attention`` (whatever name it was registered under) since import or
``reset()``: how many ran on triflash, how many in PyTorch, and why (see ``transformers_attention``)."""


def register_transformers(name: str = TRANSFORMERS_NAME) -> CallCounts:
    """Register triflash with Hugging Face transformers under ``name`` (default ``TRANSFORMERS_NAME``),
    so that ``from_pretrained(..., attn_implementation=name)`` / ``from_config(cfg, attn_implementation=
    name)``, or ``model.set_attn_implementation(name)``, runs the model's attention on triflash.

    Registers ``transformers_attention`` with ``transformers.AttentionInterface`` and its mask builder with
    ``transformers.AttentionMaskInterface`` (both are needed: see [Note: masks]). Calling it again is
    harmless. Returns ``TRANSFORMERS_COUNTS``, the calls counted by where they ran.

    Raises ImportError when transformers (>= ``TRANSFORMERS_MIN_VERSION``) is not installed
    (``pip install "triflash[hf]"``), ValueError when ``name`` contains a word transformers reads
    meaning into ("flash", "sdpa", "flex", "eager", "paged", or "/", ":", "@", "|").
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    for word in _RESERVED_WORDS:
        if word in name:
            raise ValueError(f"name must not contain {word!r}: transformers gives names containing it a meaning "
                             f"of its own (\"flash\": a FlashAttention build to import), got {name!r}")
    try:
        import transformers
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(f"register_transformers needs Hugging Face transformers >= {TRANSFORMERS_MIN_VERSION}: "
                          f"pip install \"triflash[hf]\" (or pip install transformers)") from exc
    from packaging.version import Version

    if Version(transformers.__version__) < Version(TRANSFORMERS_MIN_VERSION):
        raise ImportError(f"register_transformers needs transformers >= {TRANSFORMERS_MIN_VERSION}, found "
                          f"{transformers.__version__}")
    AttentionInterface.register(name, transformers_attention)
    AttentionMaskInterface.register(name, _transformers_mask)
    return TRANSFORMERS_COUNTS


def transformers_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention-function signature, computed by triflash (``register_transformers``
    registers it).

    query [B, Hq, Sq, D], key and value [B, Hkv, Sk, D] (GQA when Hkv < Hq); ``attention_mask`` as
    ``_transformers_mask`` built it ([Note: masks]); ``scaling`` the softmax scale (default 1/sqrt(D));
    ``sliding_window`` W: a query sees the W latest keys up to itself (triflash's ``window_size=(W - 1,
    0)``); causal from ``is_causal``, else ``module.is_causal``. With a KV cache (Sq < Sk) the queries
    are the last Sq positions: triflash's bottom-right causal alignment. ``softcap`` (Gemma 2's logit
    soft-capping) and ``s_aux`` (gpt-oss's attention sinks, [Hq], taken as float32 and trained through
    triflash's dsink) run on triflash too. Returns (out [B, Sq, Hq, D], None): no attention weights.

    Runs in PyTorch instead (counted in ``TRANSFORMERS_COUNTS["reasons"]``) for what triflash does not
    compute yet: ``"dropout"`` (attention dropout > 0 in training), and a 4-D mask: ``"queries past the keys"``
    (more queries than keys in the layer's range), ``"mask pattern"`` (not causal /
    sliding-window causal / bidirectional), ``"padding with gaps"`` (neither left nor right padding),
    ``"4-D mask from the caller"``. Inputs triflash refuses (a float64 model, a CPU tensor outside the
    interpreter, head dim > 256) raise its usual error, naming the argument.

    Padded batches cost no device synchronisation here: the mask builder reads one pair of flags per
    forward pass (as transformers' own SDPA mask does), and the layers derive the varlen offsets on the
    device.
    """
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if sliding_window is not None and sliding_window > 0:
        window = (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)
    else:
        window = validation.NO_WINDOW
    reason = None
    if dropout:
        reason = "dropout"
    elif attention_mask is not None and attention_mask.dim() != 2:
        reason = getattr(attention_mask, "_triflash_reason", "4-D mask from the caller")
    if reason is not None:
        TRANSFORMERS_COUNTS.to_torch(reason)
        return _attention_in_torch(query, key, value, attention_mask, scaling, causal, window, softcap, s_aux,
                                   dropout), None
    TRANSFORMERS_COUNTS.to_triflash()
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))             # [B, S, H, D] views
    variants = dict(softcap=float(softcap) if softcap else 0.0,
                    sinks=s_aux.float() if s_aux is not None else None)      # triflash's sinks are float32
    if attention_mask is None:
        return api.flash_attn_func(q, k, v, softmax_scale=scaling, causal=causal, window_size=window,
                                   **variants), None
    return _padded(q, k, v, attention_mask, scaling, causal, window, **variants), None


def _padding_segments(keys: torch.Tensor, seqlen_q: int):
    """Offsets that cut a padded batch into packed sequences, on the device (no sync).

    ``keys`` [B, Lk] bool marks the real tokens among the keys, one run of them per row (left or
    right padding); the queries are the keys' last ``seqlen_q`` positions. Each row b becomes three
    sequences of the packed [B * S, ...] tensors: the padding before its run, the run, the padding
    after it, each with its queries and keys. The padding sequences compute something nobody reads
    (their outputs are zeroed); the run's queries end where its keys end, so triflash's bottom-right
    causal alignment is the model's. Returns (cu_seqlens_q, cu_seqlens_k) int32 [3B + 1] and
    ``q_rows`` [B, Sq] bool, the real queries."""
    seqlen_k = keys.shape[1]
    n = keys.sum(1)                                                 # [B] real tokens per row
    start = torch.where(n > 0, keys.to(torch.int8).argmax(1), 0)   # first real key
    end = start + n
    shift = seqlen_k - seqlen_q                                     # query i sits at key i + shift
    q_start, q_end = (torch.clamp(x - shift, 0, seqlen_q) for x in (start, end))
    seg_q = torch.stack([q_start, q_end - q_start, seqlen_q - q_end], 1).flatten()
    seg_k = torch.stack([start, n, seqlen_k - end], 1).flatten()
    cu_q, cu_k = (torch.nn.functional.pad(seg.cumsum(0), (1, 0)).to(torch.int32) for seg in (seg_q, seg_k))
    return cu_q, cu_k, keys[:, shift:]


def _padded(q, k, v, keys, scale, causal, window, softcap=0.0, sinks=None):
    """q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D], ``keys`` [B, Lk] (Lk <= Sk: keys past Lk are unused
    cache slots): one ``flash_attn_varlen_func`` call over the padded tensors (``_padding_segments``),
    padded queries' rows zeroed (so their gradients, dsink's share included, are 0). Returns
    [B, Sq, Hq, D]."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = keys.shape[1]
    k, v = k[:, :seqlen_k], v[:, :seqlen_k]
    # Every layer of a forward pass gets the same mask tensor from the mask builder: its offsets are
    # derived once (a dozen small device ops) and kept on it, keyed on the queries' length and the
    # mask's version (a mask changed in place gets new offsets).
    cached = getattr(keys, "_triflash_segments", None)
    if cached is not None and cached[0] == (seqlen_q, keys._version):
        cu_q, cu_k = cached[1]
        q_rows = keys[:, seqlen_k - seqlen_q:]
    else:
        cu_q, cu_k, q_rows = _padding_segments(keys, seqlen_q)
        if type(keys) is torch.Tensor and not torch.compiler.is_compiling():
            keys._triflash_segments = ((seqlen_q, keys._version), (cu_q, cu_k))
    out = api.flash_attn_varlen_func(q.reshape(batch * seqlen_q, heads, head_dim),
                                     k.reshape(batch * seqlen_k, *k.shape[2:]),
                                     v.reshape(batch * seqlen_k, *v.shape[2:]),
                                     cu_q, cu_k, seqlen_q, seqlen_k, softmax_scale=scale, causal=causal,
                                     window_size=window, softcap=softcap, sinks=sinks)
    return out.view(batch, seqlen_q, heads, head_dim) * q_rows[:, :, None, None].to(out.dtype)


def _attention_in_torch(query, key, value, mask, scale, causal, window, softcap, sinks, dropout):
    """The calls triflash does not compute, in plain PyTorch: SDPA, or (with soft-capping or sinks, which
    SDPA lacks) the same steps written out as transformers' eager attention does them (scores in the
    input dtype, softmax in float32). Same arguments and result layout as ``transformers_attention``."""
    batch, heads, seqlen_q, head_dim = query.shape
    q_rows = None
    if mask is None or mask.dim() == 2:
        if mask is not None:
            key, value = key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]]
        allowed = causal_visible(seqlen_q, key.shape[2], query.device, window, causal)[None, None]
        if mask is not None:
            allowed = allowed & mask[:, None, None, :]
            q_rows = mask[:, mask.shape[1] - seqlen_q:]
    else:
        allowed = mask                                       # 4-D, bool or additive, as transformers made it
    if allowed.dtype == torch.bool:
        # A row that sees no key (a padded query) would make a NaN: let it see every key, then zero it.
        seen = allowed.any(-1, keepdim=True)
        allowed = allowed | ~seen
        q_rows = seen[:, 0, :, 0] if q_rows is None else q_rows & seen[:, 0, :, 0]
    scale = scale if scale is not None else head_dim**-0.5
    if (softcap is None or softcap == 0) and sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed, dropout_p=dropout, scale=scale, enable_gqa=key.shape[1] != heads)
    else:
        groups = heads // key.shape[1]
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        scores = torch.matmul(query, key.transpose(-1, -2)) * scale               # [B, H, Sq, Sk]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if allowed.dtype == torch.bool:
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        else:
            scores = scores + allowed
        if sinks is not None:               # one more logit per head, in the softmax's sum only
            sink = sinks.to(scores.dtype).reshape(1, heads, 1, 1).expand(batch, heads, seqlen_q, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        if sinks is not None:
            probs = probs[..., :-1]
        if dropout:
            probs = torch.nn.functional.dropout(probs, p=dropout)
        out = torch.matmul(probs, value)
    out = out.transpose(1, 2)
    if q_rows is not None:
        out = out * q_rows[:, :, None, None].to(out.dtype)
    return out.contiguous()


def _same_function(a, b) -> bool:
    """Whether two mask functions are the same pattern: the same code, closing over the same values
    (ints, functions compared the same way, tuples of them). How the mask builder recognises the
    sliding-window function transformers makes afresh for every forward pass."""
    if a is b:
        return True
    if not (inspect.isfunction(a) and inspect.isfunction(b)) or a.__code__ is not b.__code__:
        return False
    cells_a, cells_b = a.__closure__ or (), b.__closure__ or ()
    try:
        return len(cells_a) == len(cells_b) and all(
            _same_value(x.cell_contents, y.cell_contents) for x, y in zip(cells_a, cells_b))
    except ValueError:                                   # an empty cell
        return False


def _same_value(x, y) -> bool:
    if callable(x) or callable(y):
        return _same_function(x, y)
    if isinstance(x, tuple) and isinstance(y, tuple):
        return len(x) == len(y) and all(map(_same_value, x, y))
    return type(x) is type(y) and type(x) in (int, float, bool, str, type(None)) and x == y


def _plain_pattern(mask_function, local_size) -> bool:
    """Whether ``mask_function`` is one of the patterns triflash computes from the layer's own arguments:
    transformers' causal, bidirectional, or sliding-window causal (of ``local_size``) function."""
    from transformers import masking_utils

    plain = (getattr(masking_utils, "causal_mask_function", None),
             getattr(masking_utils, "bidirectional_mask_function", None))    # (this one since transformers 5)
    if mask_function is not None and mask_function in plain:
        return True
    return (isinstance(local_size, int) and local_size > 0
            and _same_function(mask_function, masking_utils.sliding_window_causal_mask_function(local_size)))


def _transformers_mask(batch_size, kv_length, kv_offset=0, mask_function=None, attention_mask=None,
                       local_size=None, **kwargs):
    """The mask builder registered with transformers' AttentionMaskInterface ([Note: masks]).

    transformers calls it once per forward pass and mask type with the layer's key range (``kv_offset``,
    ``kv_length``: positions in the sequence), the queries' (``q_offset`` and ``q_length``; before
    transformers 5.2 or so, ``cache_position``, their positions), the pattern (``mask_function``) and the
    2-D padding mask (``attention_mask`` [B, tokens so far], True for real tokens). One device->host
    read (two flags) per call where a padding mask is given (and, with ``cache_position``, one more
    for the first position)."""
    from transformers import masking_utils

    def sdpa_mask(reason):
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        mask = masking_utils.sdpa_mask(batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset,
                                       mask_function=mask_function, attention_mask=attention_mask,
                                       local_size=local_size, **kwargs)
        mask._triflash_reason = reason                   # read by transformers_attention, for its counts
        return mask

    if not _plain_pattern(mask_function, local_size):
        return sdpa_mask("mask pattern")
    if "q_length" in kwargs:
        q_length, q_offset = kwargs["q_length"], kwargs.get("q_offset", 0)
    else:
        positions = kwargs["cache_position"]
        q_length, q_offset = positions.shape[0], positions[0] if positions.shape[0] else 0
    # Keys past the last query are unused cache slots (a static cache's): not part of the sequence.
    n_keys = min(kv_length, int(q_offset) + q_length - kv_offset)
    if n_keys < q_length:
        return sdpa_mask("queries past the keys")
    if attention_mask is None:
        if n_keys == kv_length:
            return None
        device = kwargs.get("device", kwargs["cache_position"].device if "cache_position" in kwargs else None)
        return torch.ones(batch_size, n_keys, dtype=torch.bool, device=device)
    if attention_mask.shape[-1] < kv_offset + n_keys:
        return sdpa_mask("padding mask shorter than the keys")
    keys = attention_mask[:, kv_offset:kv_offset + n_keys].bool()
    n = keys.sum(1)
    first = keys.to(torch.int8).argmax(1)
    last = n_keys - 1 - keys.flip(1).to(torch.int8).argmax(1)
    one_run = (n == 0) | (last - first + 1 == n)
    no_padding, one_run = torch.stack([keys.all(), one_run.all()]).tolist()      # the one read
    if no_padding and n_keys == kv_length:
        return None
    if not one_run:
        return sdpa_mask("padding with gaps")
    return keys

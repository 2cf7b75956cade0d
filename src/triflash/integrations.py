"""triflash behind PyTorch's ``scaled_dot_product_attention``.

Many models (Hugging Face transformers' "sdpa" attention, torchtune, nanoGPT-style code) call
``torch.nn.functional.scaled_dot_product_attention``. Two ways to put triflash there:

* ``scaled_dot_product_attention(query, key, value, ...)``: SDPA's signature and semantics, for the
  calls triflash computes: no ``attn_mask``, no dropout, causal only with as many queries as keys
  (SDPA aligns its causal mask top-left, triflash bottom-right: the two agree only there). Anything
  else raises ``NotImplementedError`` naming the argument.
* ``sdpa_routed_to_triflash()``: a context manager that replaces
  ``torch.nn.functional.scaled_dot_product_attention`` while it is open. Calls triflash can compute go
  to it; every other call (a mask, dropout, top-left causal with Sq != Sk, an unsupported dtype or
  device, value's head dim differing from query's) goes to PyTorch's own function unchanged.
"""

from __future__ import annotations

import contextlib
import math

import torch

from . import api
from . import autograd as _autograd
from .kernels.common import last_dim_contiguous

__all__ = ["scaled_dot_product_attention", "sdpa_routed_to_triflash"]


def _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """(reason, None) when triflash cannot compute this SDPA call exactly as PyTorch would, else
    (None, run): ``run()`` computes it. The checks SDPA's semantics add come first; then the inputs,
    folded to [N, H, S, E], go through triflash.attention's own validation (``api.validate_qkv``:
    dtypes, devices, head dims, heads, scale), whose message becomes the reason."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "query, key and value must be tensors", None
    if attn_mask is not None:
        return "attn_mask is not supported (only None); use is_causal for a causal mask", None
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        return f"dropout_p must be 0.0 (triflash has no dropout), got {dropout_p!r}", None
    if not isinstance(is_causal, bool):
        return f"is_causal must be a bool, got {type(is_causal).__name__}", None
    if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
        return (f"query, key and value must have the same rank, at least 3 ([..., L, E]), got "
                f"{query.dim()}, {key.dim()} and {value.dim()}"), None
    if is_causal and query.shape[-2] != key.shape[-2]:
        return (f"is_causal with L != S (got L={query.shape[-2]}, S={key.shape[-2]}): SDPA aligns its "
                f"causal mask top-left, triflash bottom-right (use triflash.attention for that)"), None
    if key.shape[-2] == 0 and query.shape[-2] > 0:
        return "no keys (S = 0): PyTorch's softmax over nothing gives NaN, triflash 0", None
    heads_at = 3 if query.dim() >= 4 else 2                  # 3-D inputs [N, L, E] have no head dim
    lead = query.shape[:-heads_at]
    if key.shape[:-heads_at] != lead or value.shape[:-heads_at] != lead:
        return (f"batch dimensions must match: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                f"{tuple(value.shape)}"), None
    hq, hk = (query.shape[-3], key.shape[-3]) if query.dim() >= 4 else (1, 1)
    if hq != hk and not enable_gqa:
        return f"query has {hq} heads and key/value {hk}: that needs enable_gqa=True (as in SDPA)", None
    batch = math.prod(lead)                               # (not -1: any dimension may be 0)
    q4, k4, v4 = (t.unsqueeze(1) if t.dim() == 3 else t.reshape(batch, *t.shape[-3:]) for t in tensors)
    try:
        scale = api.validate_qkv(q4, k4, v4, "bhsd", "scale", scale, is_causal)
    except (TypeError, ValueError) as exc:
        return str(exc), None

    def run():
        # triflash.attention's body, its validation done above.
        q, k, v = (last_dim_contiguous(t) for t in (q4, k4, v4))
        out, _ = _autograd.forward(q, k, v, scale, is_causal, True)
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
        raise NotImplementedError(f"triflash.integrations.scaled_dot_product_attention: {why}")
    return run()


@contextlib.contextmanager
def sdpa_routed_to_triflash():
    """While open, ``torch.nn.functional.scaled_dot_product_attention`` runs triflash for the calls it
    supports and PyTorch's own function for the others. Yields a dict counting the calls each way
    (``{"triflash": n, "torch": m}``), so a model's coverage can be checked.

    Code that imported the function by name before the block (``from torch.nn.functional import
    scaled_dot_product_attention``) keeps PyTorch's.
    """
    original = torch.nn.functional.scaled_dot_product_attention
    counts = {"triflash": 0, "torch": 0}

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        why, run = _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if why is None:
            counts["triflash"] += 1
            return run()
        counts["torch"] += 1
        kwargs = {"enable_gqa": enable_gqa} if enable_gqa else {}
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = routed
    try:
        yield counts
    finally:
        torch.nn.functional.scaled_dot_product_attention = original

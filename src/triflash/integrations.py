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
from .kernels import configs

__all__ = ["scaled_dot_product_attention", "sdpa_routed_to_triflash"]


def _unsupported(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> str | None:
    """Why triflash cannot compute this SDPA call exactly as PyTorch would, or None when it can."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "query, key and value must be tensors"
    if attn_mask is not None:
        return "attn_mask is not supported (only None); use is_causal for a causal mask"
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        return f"dropout_p must be 0.0 (triflash has no dropout), got {dropout_p!r}"
    if not isinstance(is_causal, bool):
        return f"is_causal must be a bool, got {type(is_causal).__name__}"
    if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
        return (f"query, key and value must have the same rank, at least 3 ([..., L, E]), got "
                f"{query.dim()}, {key.dim()} and {value.dim()}")
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        return (f"key's and value's last dimension (E) must equal query's ({query.shape[-1]}), got "
                f"{key.shape[-1]} and {value.shape[-1]}")
    if key.shape[-2] != value.shape[-2]:
        return f"key and value must have the same length S, got {key.shape[-2]} and {value.shape[-2]}"
    if is_causal and query.shape[-2] != key.shape[-2]:
        return (f"is_causal with L != S (got L={query.shape[-2]}, S={key.shape[-2]}): SDPA aligns its "
                f"causal mask top-left, triflash bottom-right (use triflash.attention for that)")
    if query.dtype not in api.SUPPORTED_DTYPES or any(t.dtype != query.dtype for t in tensors):
        return f"dtypes must be one of float16, bfloat16, float32 and equal, got {[t.dtype for t in tensors]}"
    if any(t.device != query.device for t in tensors):
        return "query, key and value must be on one device"
    if not (query.device.type == "cuda" or (query.device.type == "cpu" and configs.INTERPRET)):
        return f"triflash runs on CUDA devices, got {query.device}"
    if not 1 <= query.shape[-1] <= api.MAX_HEAD_DIM:
        return f"E (head dim) must be between 1 and {api.MAX_HEAD_DIM}, got {query.shape[-1]}"
    heads_at = 3 if query.dim() >= 4 else 2                  # 3-D inputs [N, L, E] have no head dim
    hq, hk = (query.shape[-3], key.shape[-3]) if query.dim() >= 4 else (1, 1)
    if query.shape[:-heads_at] != key.shape[:-heads_at] or key.shape[:-2] != value.shape[:-2]:
        return (f"batch dimensions must match: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                f"{tuple(value.shape)}")
    if key.shape[-2] == 0 and query.shape[-2] > 0:
        return "no keys (S = 0): PyTorch's softmax over nothing gives NaN, triflash 0"
    if hk == 0:
        return "key and value have no heads"
    if hq != hk and not (enable_gqa and hq % hk == 0):
        return (f"query has {hq} heads and key/value {hk}: that needs enable_gqa=True and a multiple "
                f"(as in SDPA)")
    if scale is not None:
        try:
            api._check_scale(scale, "scale", query.shape[-1])       # a normal float32 number > 0
        except (TypeError, ValueError) as exc:
            return str(exc)
    return None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` computed by triflash.

    query [..., Hq, L, E], key and value [..., Hkv, S, E] (SDPA's layout; 3-D inputs have one head).
    ``is_causal`` (with L == S), ``scale`` (default 1/sqrt(E)) and ``enable_gqa`` (Hq a multiple of
    Hkv) as in SDPA. Returns [..., Hq, L, E], differentiable like ``triflash.attention``.

    Raises NotImplementedError for what triflash does not compute (see the module docstring),
    before any launch.
    """
    why = _unsupported(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if why is not None:
        raise NotImplementedError(f"triflash.integrations.scaled_dot_product_attention: {why}")
    return _attention(query, key, value, is_causal, scale)


def _attention(query, key, value, is_causal, scale):
    """triflash.attention on [..., H, L, E] inputs of any rank >= 3 (leading dims folded into one
    batch dimension, a view when they allow it)."""
    lead = query.shape[:-3] if query.dim() >= 4 else query.shape[:-2]
    batch = math.prod(lead)                               # (not -1: any dimension may be 0)

    def as_bhsd(t):
        if t.dim() == 3:
            return t.unsqueeze(1)                          # [N, L, E] -> [N, 1, L, E]
        return t.reshape(batch, *t.shape[-3:])
    out = api.attention(as_bhsd(query), as_bhsd(key), as_bhsd(value), causal=bool(is_causal),
                        sm_scale=scale)
    return out.reshape(*lead, *out.shape[-3 if query.dim() >= 4 else -2:])


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
        if _unsupported(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) is None:
            counts["triflash"] += 1
            return _attention(query, key, value, is_causal, scale)
        counts["torch"] += 1
        kwargs = {"enable_gqa": enable_gqa} if enable_gqa else {}
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = routed
    try:
        yield counts
    finally:
        torch.nn.functional.scaled_dot_product_attention = original

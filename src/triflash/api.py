"""Public entry points: validation, layouts, dispatch.

Two layouts, one kernel:

* ``flash_attn_func``: FlashAttention's [batch, seqlen, heads, head_dim].
* ``attention``: the seeds' (and SDPA's) [batch, heads, seqlen, head_dim].

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
from .kernels import configs
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


def _require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")


def _check_heads(heads_q: int, heads_kv: int) -> None:
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


def _check_scale(softmax_scale, name: str, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {softmax_scale!r}")
    return scale


def validate_qkv(q, k, v, layout: str, scale_name: str = "softmax_scale", softmax_scale=None,
                 causal=False) -> float:
    """Check q/k/v for ``layout`` before any launch; return the softmax scale to use.

    Raises TypeError (wrong types or dtypes) or ValueError (shapes, devices, values), naming the
    argument with what was expected and what was received.
    """
    dims_doc = _LAYOUTS[layout][0]
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_tensor(name, t)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_rank(name, t, 4, dims_doc)
    _require_float_dtype("q", q)
    for name, t in (("k", k), ("v", v)):
        _require_like_q(name, t, q)
    _check_device("q", q)
    _require_bool("causal", causal)

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




def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False):
    """Attention in FlashAttention's layout.

    Args:
        q: [batch, seqlen_q, heads_q, head_dim], float16 / bfloat16 / float32, on a CUDA device.
        k, v: [batch, seqlen_k, heads_kv, head_dim], same dtype and device. heads_q must be a multiple
            of heads_kv: each group of heads_q // heads_kv query heads shares one K/V head (GQA; MQA
            when heads_kv == 1).
        softmax_scale: multiplies q @ k^T before the softmax; default 1 / sqrt(head_dim).
        causal: mask keys after the query, aligned bottom-right: query i sees key j when
            j <= i + seqlen_k - seqlen_q. A query that sees no key gets out = 0 and lse = -inf.
        return_lse: also return the log-sum-exp of the scaled scores.

    Returns:
        out [batch, seqlen_q, heads_q, head_dim] in q's dtype; with ``return_lse``, (out, lse) where
        lse is [batch, heads_q, seqlen_q] float32, natural log.
    """
    scale = validate_qkv(q, k, v, "bshd", "softmax_scale", softmax_scale, causal)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    out, lse = _autograd.forward(q, k, v, scale, causal, False)
    return (out, lse) if return_lse else out


def attention(q, k, v, causal=False, sm_scale=None, return_lse=False):
    """Attention in the seeds' (and SDPA's) layout.

    Args:
        q: [batch, heads_q, seqlen_q, head_dim]; k, v: [batch, heads_kv, seqlen_k, head_dim].
        causal, sm_scale, return_lse: as ``flash_attn_func``'s causal, softmax_scale, return_lse.

    Returns:
        out [batch, heads_q, seqlen_q, head_dim] (contiguous) in q's dtype; with ``return_lse``,
        (out, lse) with lse [batch, heads_q, seqlen_q] float32, natural log.
    """
    scale = validate_qkv(q, k, v, "bhsd", "sm_scale", sm_scale, causal)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    out, lse = _autograd.forward(q, k, v, scale, causal, True)
    return (out, lse) if return_lse else out

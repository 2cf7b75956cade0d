"""Argument checks shared by every public entry point (api.py, kvcache.py, integrations.py).

Each raises TypeError or ValueError naming the argument, what was expected and what was received,
before any tensor is written or any kernel launched. They look at Python values and tensor
metadata only: no device work, no synchronisation.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from .kernels import configs, launch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


MAX_HEAD_DIM = 256


LAYOUTS = {
    # layout name -> (dim names in order, index of seqlen, index of heads)
    "bshd": ("[batch, seqlen, heads, head_dim]", 1, 2),
    "bhsd": ("[batch, heads, seqlen, head_dim]", 2, 1),
}


class Shape(NamedTuple):
    batch: int
    seqlen: int
    heads: int
    head_dim: int


def dims(t: torch.Tensor, layout: str) -> Shape:
    _, s_dim, h_dim = LAYOUTS[layout]
    return Shape(t.shape[0], t.shape[s_dim], t.shape[h_dim], t.shape[3])


def require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def require_rank(name: str, t: torch.Tensor, rank: int, doc: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {doc}, got {t.dim()}-D tensor of shape "
                         f"{tuple(t.shape)}")


def require_float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}.dtype must be one of float16, bfloat16, float32, got {t.dtype}")


def require_like_q(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    """Same dtype and device as q."""
    if t.dtype != q.dtype:
        raise TypeError(f"{name}.dtype must match q.dtype ({q.dtype}), got {t.dtype}")
    require_same_device(name, t, q)


def require_same_device(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    if t.device != q.device:
        raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")


def type_name(value) -> str:
    """The type's name, with its module when it is not a builtin (numpy.bool, not a bare "bool")."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type_name(value)}")


def check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")


def check_heads(heads_q: int, heads_kv: int) -> None:
    if heads_q == 0 and heads_kv == 0:
        return                            # no heads at all: an empty result, as in SDPA
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"the number of query heads must be a multiple of the number of key/value "
                         f"heads (GQA/MQA): expected Hq % Hkv == 0, got Hq={heads_q}, Hkv={heads_kv}")


def check_device(name: str, t: torch.Tensor) -> None:
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


SCALE_RANGE = (2.0**-126, 2.0**127)


def check_scale(softmax_scale, name: str, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = _real(name, softmax_scale, "a real number or None")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {softmax_scale!r}")
    if not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]:
        raise ValueError(f"{name} must be between 2^-126 and 2^127 (a normal float32 number, as the "
                         f"kernels use it), got {softmax_scale!r}")
    return scale


def require_qkv(q, k, v, rank: int, q_doc: str, kv_doc: str, causal, kv_names=("k", "v")) -> None:
    """The checks every attention entry point starts with: tensors of ``rank`` dims, q's dtype one
    triflash computes, k and v like q, a device that runs the kernels, causal a bool. ``kv_names``:
    what the caller calls k and v (k_cache, v_cache for the decode)."""
    (k_name, v_name) = kv_names
    for name, t in (("q", q), (k_name, k), (v_name, v)):
        require_tensor(name, t)
    for name, t, doc in (("q", q, q_doc), (k_name, k, kv_doc), (v_name, v, kv_doc)):
        require_rank(name, t, rank, doc)
    require_float_dtype("q", q)
    for name, t in ((k_name, k), (v_name, v)):
        require_like_q(name, t, q)
    check_device("q", q)
    require_bool("causal", causal)


def check_window(window_size, causal: bool) -> tuple[int, int]:
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


NO_WINDOW = (-1, -1)


def window_key(window_size):
    return window_size if window_size is NO_WINDOW else (window_size, tuple(map(type, window_size)))


def check_dropout(dropout_p) -> None:
    """FlashAttention's ``dropout_p``, accepted for drop-in use: only 0 (triflash has no dropout)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a number (0.0: triflash has no dropout), got {type_name(dropout_p)}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p must be 0.0: triflash has no attention dropout, got {dropout_p!r} (apply "
                         f"dropout outside the attention call, or use PyTorch's scaled_dot_product_attention)")


def require_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type_name(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_softcap(softcap) -> float:
    """softcap: 0 (no soft-capping) or a normal float32 number > 0 (the kernels hold it, and the
    scale divided by it, in float32: 1e39 gave NaN outputs)."""
    value = _real("softcap", softcap, "a real number (0.0: no soft-capping)")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0.0: no soft-capping), got {softcap!r}")
    if value and not SCALE_RANGE[0] <= value <= SCALE_RANGE[1]:
        raise ValueError(f"softcap must be 0 or between 2^-126 and 2^127 (a normal float32 number, as the "
                         f"kernels use it), got {softcap!r}")
    return value


def _real(name: str, value, expected: str) -> float:
    """A Python / numpy real number as a float (inf where it overflows one); TypeError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {type_name(value)}")
    try:
        return float(value)
    except OverflowError:
        return math.inf


def check_score_variants(softcap, alibi_slopes, sinks, q: torch.Tensor, batch: int, heads_q: int,
                         grad_name: str | None = None) -> float:
    """The score variants' arguments ([Note: score variants] in kernels/common.py); returns softcap as a
    float. alibi_slopes: float32 [heads_q] or [batch, heads_q] on q's device, not requiring grad while
    autograd records (the slopes are not differentiable); sinks: float32 [heads_q] on q's device.
    ``grad_name``: the entry point, where sinks may not require grad either (decode has no backward)."""
    value = check_softcap(softcap)
    if alibi_slopes is not None:
        require_tensor("alibi_slopes", alibi_slopes)
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes.dtype must be torch.float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((heads_q,), (batch, heads_q)):
            raise ValueError(f"alibi_slopes must be [heads_q] = ({heads_q},) or [batch, heads_q] = ({batch}, "
                             f"{heads_q}), got {tuple(alibi_slopes.shape)}")
        require_same_device("alibi_slopes", alibi_slopes, q)
        if alibi_slopes.requires_grad and torch.is_grad_enabled():
            raise ValueError("alibi_slopes requires grad, but the ALiBi slopes are not differentiable (as in "
                             "FlashAttention 2): expected a tensor without requires_grad; pass "
                             "alibi_slopes.detach()")
    if sinks is not None:
        require_tensor("sinks", sinks)
        if sinks.dtype != torch.float32:
            raise TypeError(f"sinks.dtype must be torch.float32, got {sinks.dtype}")
        if tuple(sinks.shape) != (heads_q,):
            raise ValueError(f"sinks must be [heads_q] = ({heads_q},) (one logit per query head), got "
                             f"{tuple(sinks.shape)}")
        require_same_device("sinks", sinks, q)
        if grad_name is not None and sinks.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"sinks requires grad, but {grad_name} has no backward (it is for inference): "
                             f"expected a tensor without requires_grad; call it under torch.no_grad() or pass "
                             f"sinks.detach()")
    return value


def variant_key(softcap, alibi_slopes, sinks):
    """The score variants' part of a call key (None: no key, validate on every call: a tensor that
    is not a plain one, or slopes that require grad, which validation refuses while autograd records)."""
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        return None
    return (softcap, softcap.__class__, None if alibi_slopes is None else launch.meta(alibi_slopes),
            None if sinks is None else (launch.meta(sinks), sinks.requires_grad))

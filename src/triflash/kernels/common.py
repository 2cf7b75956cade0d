"""Small @triton.jit helpers (and host constants) shared by the kernels."""

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import configs


def on_input_device(launcher):
    """Run a launcher with its first tensor argument's GPU as the current device. Triton launches on
    the current device, so without this, tensors on another GPU (cuda:1 while cuda:0 is current)
    would be handed to a kernel running on the wrong one."""
    @functools.wraps(launcher)
    def wrapped(*args, **kwargs):
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if first.device.type != "cuda" or first.device.index == torch.cuda.current_device():
            return launcher(*args, **kwargs)
        with torch.cuda.device(first.device):
            return launcher(*args, **kwargs)
    return wrapped


class Varlen(NamedTuple):
    """A variable-length batch (FlashAttention's varlen layout): the sequences are packed one after
    another along dim 0 of q [total_q, Hq, D] and k / v [total_k, Hkv, D]. Sequence b owns rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1
    of k / v (both [B + 1] int32, from 0, non-decreasing); max_seqlen_q / max_seqlen_k bound the
    lengths (they size the grids)."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


class ScoreVariant(NamedTuple):
    """A call's score variants ([Note: score variants]), validated: ``softcap`` (0: none),
    ``alibi_slopes`` ([Hq] or [B, Hq] float32, or None), ``sinks`` ([Hq] float32, or None). The
    kernels take them as ``transform_kwargs`` and ``sink_kwargs`` (None where a variant is off: no
    kernel parameter, and the flag False)."""
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    @property
    def any(self) -> bool:
        return self.softcap > 0 or self.alibi_slopes is not None or self.sinks is not None

    @property
    def names(self) -> frozenset:
        """The variants in use, by name: "softcap", "alibi", "sinks"."""
        return frozenset(n for n, on in (("softcap", self.softcap > 0), ("alibi", self.alibi_slopes is not None),
                                         ("sinks", self.sinks is not None)) if on)

    def transform_kwargs(self, sm_scale: float) -> dict:
        """The launch keywords of softcap and ALiBi (every kernel family): tanh_scale = sm_scale /
        softcap, softcap, ALIBI_SLOPES and its batch / head strides ([Hq] slopes: batch stride 0), and
        the SOFTCAP / ALIBI flags; None / False where off. tanh_scale is capped at float32's largest
        value: past it the kernels' float32 copy would be inf, and a zero score (a zero query row)
        inf * 0 = NaN; capped, a zero score gives tanh 0 and any other +-1, as the true scale does
        (the gradients take sm_scale, not tanh_scale)."""
        capped = self.softcap > 0
        a = self.alibi_slopes
        strides = (None, None) if a is None else (0, a.stride(0)) if a.dim() == 1 else (a.stride(0), a.stride(1))
        return dict(tanh_scale=min(sm_scale / self.softcap, FLOAT32_MAX) if capped else None,
                    softcap=self.softcap if capped else None,
                    ALIBI_SLOPES=a, stride_ab=strides[0], stride_ah=strides[1], SOFTCAP=capped, ALIBI=a is not None)

    def sink_kwargs(self, in_kernel: bool = True) -> dict:
        """The launch keywords of the sinks for a forward or decode kernel: SINKS and HAS_SINKS (None /
        False where there are none, or where the sink is added elsewhere: ``in_kernel=False``, the
        split decode's merge). The backward kernels take none: the LSE includes the sink."""
        on = in_kernel and self.sinks is not None
        return dict(SINKS=self.sinks if on else None, HAS_SINKS=on)

    def fill_no_keys(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """The forward of a call with no key at all, where every row is empty: out 0, lse -inf (with
        sinks, the head's sink). lse [B, Hq, S], or packed sequences' [Hq, total_q]."""
        out.zero_()
        lse = lse if lse.dim() == 3 else lse.unsqueeze(0)
        if self.sinks is None:
            lse.fill_(float("-inf"))
        else:
            lse.copy_(self.sinks[None, :, None].expand(lse.shape))


PLAIN = ScoreVariant()


def needs_int64_rows(*tensors: torch.Tensor) -> bool:
    """Whether a pointer-loading kernel needs 64-bit row offsets (its ``LONG`` flag) for these
    [..., S, H, D] tensors. The kernels form a (batch, head)'s base offset in int64, but an offset
    inside it, row * row stride + lane, in int32: that wraps once (S - 1) * |row stride| + D passes
    2^31 - 1 (in FlashAttention's layout, S * H * D elements: 512k rows of 32 heads x 128 lanes).
    Arguments that are not tensors (TMA descriptors, which take coordinates) are skipped."""
    return any(isinstance(t, torch.Tensor) and rows_past_int32(t.shape[-3], abs(t.stride(-3)), t.shape[-1])
               for t in tensors)


def rows_past_int32(rows: int, row_stride: int, width: int) -> bool:
    """Whether the last of ``rows`` rows (``row_stride`` apart, ``width`` lanes each) ends past
    2^31 - 1 elements from the first."""
    return rows > 0 and (rows - 1) * row_stride + width > 2**31 - 1


@triton.jit
def wide(stride, LONG: tl.constexpr):
    """A row stride as the kernels multiply it: int64 when LONG (see ``needs_int64_rows``), so that
    row * stride cannot wrap; else as it came (int32), so nothing changes for the usual sizes."""
    if LONG:
        return tl.cast(stride, tl.int64)
    else:
        return stride


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy when its last dimension is strided: the kernels need unit stride on head_dim only
    and read every other dimension through its stride."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def unit_stride(vec: torch.Tensor | None) -> torch.Tensor | None:
    """A [N] vector the kernels read with unit stride (the sinks): a differentiable copy only where it
    has another stride."""
    return vec if vec is None or vec.stride(0) == 1 or vec.shape[0] <= 1 else vec.contiguous()


LOG2E = math.log2(math.e)   # host side: qk_scale = sm_scale * LOG2E, rounded once to fp32
FLOAT32_MAX = 3.4028234663852886e38          # float32's largest finite value
# The same constants inside kernels.
LOG2E_K = tl.constexpr(LOG2E)
LN2_K = tl.constexpr(math.log(2.0))

# libdevice exists only when compiling for the GPU (the interpreter has none). Two uses:
# * on the GPU, tl.log / tl.math.log2 become the MUFU's approximate lg2 (a few ulps off); the LSE is an
#   output users compare and merge, so its one log per row goes through libdevice's accurate log (the
#   interpreter's tl.log is numpy's, already accurate);
# * fp32 paths need a few products rounded on their own, never fused by the compiler into an FMA with
#   the next addition (ptxas contracts a * b + c; libdevice's mul_rn / add_rn are never contracted;
#   the interpreter's numpy never fuses).
LIBDEVICE = tl.constexpr(not configs.INTERPRET)
# NVIDIA's tanh.approx.f32 (one MUFU operation, relative error below 2^-10.9) instead of libdevice's
# polynomial for fp16/bf16 inputs: their scores already carry rounding of that size, and libdevice's
# tanh made the softcap kernels 2-3x slower (docs/performance.md#score-variants-on-hopper). The
# backward's factor 1 - tanh^2 takes the same error in absolute terms (relatively larger near
# saturation, where the factor and so dS are small), as in FlashAttention 2/3. fp32 inputs keep
# libdevice's; ROCm and the interpreter have no PTX.
PTX_TANH = tl.constexpr(not configs.INTERPRET and torch.version.hip is None)


@triton.jit
def mul_rn(a, b):
    """a * b rounded to fp32 once, never fused into a following addition."""
    if LIBDEVICE:
        return libdevice.mul_rn(a, b)
    else:
        return a * b


@triton.jit
def add_rn(a, b):
    """a + b as its own rounded addition: a block's partial sum (a dot with no accumulator) added to
    a running total, instead of Triton folding the addition into the dot, which for IEEE fp32 dots
    would make the whole total one long sequential chain of FMAs."""
    if LIBDEVICE:
        return libdevice.add_rn(a, b)
    else:
        return a + b


@triton.jit
def div_rn(a, b):
    """a / b rounded once (IEEE). Triton's fp32 division on the GPU is div.full.f32, within about
    2 ulp: at |out| ~ 4 that alone is ~1e-6, the whole error budget of an fp32 output."""
    if LIBDEVICE:
        return libdevice.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _halves_of_columns(a):
    """a [M, K] -> (a[:, :K/2], a[:, K/2:])."""
    M: tl.constexpr = a.shape[0]
    K: tl.constexpr = a.shape[1]
    return tl.split(tl.permute(tl.reshape(a, [M, 2, K // 2]), [0, 2, 1]))


@triton.jit
def _halves_of_rows(b):
    """b [K, N] -> (b[:K/2, :], b[K/2:, :])."""
    K: tl.constexpr = b.shape[0]
    N: tl.constexpr = b.shape[1]
    return tl.split(tl.permute(tl.reshape(b, [2, K // 2, N]), [1, 2, 0]))


@triton.jit
def score_dot(q, k, DOT_PRECISION: tl.constexpr, BLOCKED: tl.constexpr):
    """q [BM, BD] @ k [BD, BN]: the raw scores. BLOCKED (IEEE fp32): the head dim is summed in chunks
    of at most 64 lanes whose products are then added pairwise (``add_rn``). Triton's IEEE fp32 dot on
    the GPU is one sequential FMA chain per score, so at BD = 256 a score carries ~4 ulp of rounding
    where cuBLAS's blocked sum carries ~1; over a few keys of |score| ~ 30 that was the whole fp32
    error budget of a decode output (docs/performance-notes.md#numerics)."""
    BD: tl.constexpr = q.shape[1]
    if BLOCKED and BD >= 128:
        q0, q1 = _halves_of_columns(q)
        k0, k1 = _halves_of_rows(k)
        if BD >= 256:
            q00, q01 = _halves_of_columns(q0)
            q10, q11 = _halves_of_columns(q1)
            k00, k01 = _halves_of_rows(k0)
            k10, k11 = _halves_of_rows(k1)
            s0 = add_rn(tl.dot(q00, k00, input_precision=DOT_PRECISION),
                        tl.dot(q01, k01, input_precision=DOT_PRECISION))
            s1 = add_rn(tl.dot(q10, k10, input_precision=DOT_PRECISION),
                        tl.dot(q11, k11, input_precision=DOT_PRECISION))
        else:
            s0 = tl.dot(q0, k0, input_precision=DOT_PRECISION)
            s1 = tl.dot(q1, k1, input_precision=DOT_PRECISION)
        return add_rn(s0, s1)
    else:
        return tl.dot(q, k, input_precision=DOT_PRECISION)


@triton.jit
def accumulate_pv(acc, p, v, DOT_PRECISION: tl.constexpr, BLOCKED: tl.constexpr):
    """acc + p @ v. BLOCKED (fp32): the tile's product summed on its own, then added (``add_rn``):
    over a long sequence each output element then carries one rounding chain per key block, where
    the dot's own accumulator would carry one per key (IEEE fp32 dots are sequential FMAs)."""
    if BLOCKED:
        return add_rn(acc, tl.dot(p, v, input_precision=DOT_PRECISION))
    else:
        return tl.dot(p, v, acc, input_precision=DOT_PRECISION)


@triton.jit
def natural_log(x):
    """ln(x), elementwise (fp32 or fp64), accurate to about an ulp on the GPU."""
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def tanh(x, APPROX: tl.constexpr = False):
    """tanh(x) of fp32 x: on NVIDIA GPUs with APPROX the hardware's tanh.approx.f32 (see PTX_TANH),
    else libdevice's; in the interpreter (no libdevice) the formula sign(x) (1 - e^{-2|x|}) /
    (1 + e^{-2|x|}) in float64, rounded once to fp32 (no overflow, and no cancellation error near 0
    at fp32 precision)."""
    if LIBDEVICE:
        if APPROX and PTX_TANH:
            return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return libdevice.tanh(x)
    else:
        t = x.to(tl.float64)
        e = tl.exp(-2.0 * tl.abs(t))
        th = (1.0 - e) / (1.0 + e)
        return tl.where(t < 0, -th, th).to(tl.float32)


# [Note: score variants] Three optional changes to the scores, each a constexpr flag that compiles
# its code in only when a call uses it (with every flag off the kernels are the plain ones):
#
# * SOFTCAP (Gemma 2, Grok): s = softcap * tanh(sm_scale * qk / softcap), before masking;
# * ALIBI (BLOOM, MPT): s += -slope * |i + seqlen_k - seqlen_q - j|, after the cap, per sequence;
# * SINKS (gpt-oss): one more logit per query head in every row's softmax denominator, with no value.
#
# The plain kernels keep the row max in raw score units and fold sm_scale * log2(e) into the exp2.
# With SOFTCAP or ALIBI the scores are no longer a multiple of qk, so ``score_mod`` turns each tile
# into natural-unit scores s first; the online softmax then runs with scale log2(e) (m in natural
# units) and the LSE is formed with scale 1. SINKS touches only the epilogue (``add_sink``): the
# sink joins the running (max, sum) like one more score, the output takes no value from it, and the
# LSE includes it. The backward recomputes P from that LSE, so P (and dV, dK, dQ) need nothing more
# for sinks; dsink = -sum over rows of exp(sink - lse) * delta (``backward.preprocess``: per block of rows,
# then ``_sink_grad_kernel`` adds them up).
# SOFTCAP's chain rule in the backward: dS_raw = dS * (1 - tanh^2); ALiBi is a constant bias.


@triton.jit
def score_mod(qk, rows, cols, off, sm_scale, tanh_scale, softcap, slope, SOFTCAP: tl.constexpr,
              ALIBI: tl.constexpr, APPROX: tl.constexpr = False):
    """Raw scores qk (any 2-D tile) -> (s, t): s the natural-unit scores with the cap and the bias
    ([Note: score variants]), t = tanh(qk * tanh_scale) for SOFTCAP's chain rule (else qk).
    rows / cols: query and key positions, broadcast to the tile's orientation; off = seqlen_k -
    seqlen_q; tanh_scale = sm_scale / softcap; slope: a scalar or a tile-broadcastable column.
    APPROX (the inputs are fp16/bf16): the hardware tanh, see ``tanh``."""
    if SOFTCAP:
        t = tanh(qk * tanh_scale, APPROX)
        s = softcap * t
    else:
        t = qk
        s = qk * sm_scale
    if ALIBI:
        # The distance in fp32, each side converted before broadcasting: exact (whole numbers below
        # 2^24), and one add per score where an integer distance costs an abs and a conversion too.
        s = s - slope * tl.abs((rows + off).to(tl.float32) - cols.to(tl.float32))
    return s, t


@triton.jit
def add_sink(acc, l_i, m_i, sink):
    """Fold a sink logit (natural units; a scalar or one per row) into the final online-softmax state
    (m_i in natural units): one more term exp(sink - m) in the sum, none in acc. A row that saw no key
    gets l = 1 at m = sink, so its output is 0 and its LSE the sink. A sink of -inf adds nothing."""
    m_new = tl.maximum(m_i, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2((m_i - m_safe) * LOG2E_K)
    l_new = l_i * alpha + tl.math.exp2((sink - m_safe) * LOG2E_K)
    return acc * alpha[:, None], l_new, m_new


@triton.jit
def online_softmax_step(qk, visible, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr,
                        PRECISE: tl.constexpr):
    """Fold one tile of raw scores qk [BM, BN] into the running state.

    m_i [BM]: running max of the raw scores; l_i [BM]: running sum of exp(score - max); acc [BM, BD]:
    running sum of exp(score - max) * v. Returns (p, m_new, l_new, acc rescaled): the caller adds
    p @ v to acc. Exponentials are base 2 with qk_scale = sm_scale * log2(e) folded into one FMA.
    MASKED: ``visible`` [BM, BN] (or broadcastable) hides scores; rows that have seen no key keep
    m = -inf, l = 0, and never produce NaN.
    PRECISE (fp32): p = exp2((score - max) * qk_scale) instead, one more instruction per score. The
    row's largest score then gets p = 1 exactly, as in PyTorch's softmax, where the fused form
    exp2(fma(score, qk_scale, -round(max * qk_scale))) keeps the rounding error of max * qk_scale.
    (With one key, the fused form gives l = 1 + ~1e-7, and every p the backward recomputes from the
    LSE inherits it.)"""
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))                         # [BM]
        # Subtract 0 from a row still at -inf, so exp2(-inf - (-inf)) = NaN never happens.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))                         # every score is real here
        m_safe = m_new
    if PRECISE:
        p = tl.math.exp2((qk - m_safe[:, None]) * qk_scale)            # [BM, BN]
    else:
        p = tl.math.exp2(qk * qk_scale - (m_safe * qk_scale)[:, None])  # [BM, BN]
    # alpha from the difference of raw maxima: exactly 1 while the max stands. (exp2(m_i*c - m_new*c)
    # is not: the compiler fuses it into an FMA that keeps the rounding error of m*c, and that factor
    # then compounds over every key block.) Rows still at -inf get 0 instead of NaN.
    alpha = tl.math.exp2(tl.where(m_new == float("-inf"), 0.0, (m_i - m_new) * qk_scale))  # [BM]
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, m_new, l_new, acc * alpha[:, None]


@triton.jit
def load_kv_tile(ptrs, n_ok, d_ok, MASKED: tl.constexpr, PAD_D: tl.constexpr):
    """Load a K or V tile. n_ok / d_ok are the key-row and head-dim masks already broadcast to the
    tile's orientation ([1, BN] and [BD, 1] for a transposed K tile, [BN, 1] and [1, BD] for V).
    MASKED: keys past the end are read as 0; PAD_D: lanes past HEAD_DIM (BLOCK_D > HEAD_DIM) too.
    Off-band tiles of a power-of-two head dim load with no mask at all."""
    if MASKED:
        return tl.load(ptrs, mask=d_ok & n_ok, other=0.0)
    elif PAD_D:
        return tl.load(ptrs, mask=d_ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def finish_rows(acc, l_i, m_i, sm_scale, LSE_F64: tl.constexpr = False, PRECISE: tl.constexpr = False):
    """Epilogue of the online softmax: (out [BM, BD] = acc / l, lse [BM] = m * sm_scale + ln l).
    A row that saw no key (l = 0) gets out = 0 and lse = -inf, never NaN. LSE_F64: the LSE formed
    and returned in float64 (fp32 split-KV partials, see decode.py). PRECISE (fp32): an IEEE
    division (``div_rn``)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if PRECISE:
        out = div_rn(acc, l_safe[:, None])
    else:
        out = acc / l_safe[:, None]
    if LSE_F64:
        lse = m_i.to(tl.float64) * sm_scale + natural_log(l_safe.to(tl.float64))
    else:
        lse = m_i * sm_scale + natural_log(l_safe)
    return out, tl.where(empty, float("-inf"), lse)


def partial_and_table_strides(o_part, l_part, cache_seqlens, block_table) -> dict[str, int]:
    """The stride keyword arguments both decode kernels (decode.py's and decode_hopper.py's) take
    after the query's: o_part's four and l_part's three (the split axis's stride 0 when there is one
    split: o_part and l_part are then the final out and lse with a leading axis, whose stride may not
    fit 32 bits), then cache_seqlens' one and block_table's two (0 where absent)."""
    one = o_part.shape[0] == 1
    values = (0 if one else o_part.stride(0), *o_part.stride()[1:4],
              0 if one else l_part.stride(0), *l_part.stride()[1:3],
              cache_seqlens.stride(0) if cache_seqlens is not None else 0,
              *(block_table.stride() if block_table is not None else (0, 0)))
    return dict(zip(("stride_on", "stride_ob", "stride_os", "stride_oh", "stride_ln", "stride_lb", "stride_lh",
                     "stride_sl", "stride_btb", "stride_btp"), values))

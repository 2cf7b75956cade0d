"""Context parallelism: attention over a sequence split across the ranks of a torch.distributed group.

Each rank holds a slice of the sequence (q, k and v in FlashAttention's [batch, seqlen, heads, head_dim]
layout) and gets the attention output of its own queries over the whole sequence, as if one GPU had run
``flash_attn_func`` on the full tensors. Two ways to see the other ranks' keys:

* ``ring_flash_attn_func``: the K/V blocks travel around the ring of ranks, one hop per step, while
  each rank computes its queries against the block it holds; the partial results merge through their
  log-sum-exp (``merge_attn_states``). The backward runs the ring again: the K/V blocks travel with
  fp32 accumulators of their gradients, which reach their owner after the last step (no all-reduce).
* ``allgather_flash_attn_func``: every rank gathers the whole K/V (one all-gather), computes its own
  queries against it, and the K/V gradients go home through one reduce-scatter. Cheap where K/V is small
  next to q (GQA / MQA), as in Llama 3's training.

Glossary
--------
W           the group's size (``world``); r a rank in the group.
S, L        the full sequence length, and the length each rank holds (S = W * L).
sharding    how the sequence is cut: ``"contiguous"`` (rank r holds tokens [r L, (r + 1) L)) or
            ``"zigzag"`` (the sequence cut into 2W chunks of L / 2; rank r holds chunk r followed by
            chunk 2W - 1 - r). Zigzag balances causal attention: every rank does the same work at every
            ring step. ``shard_sequence`` / ``unshard_sequence`` / ``gather_sequence`` cut and join.
segment     a run of tokens contiguous in both the sequence and a rank's memory: (first position, length).
piece       one kernel call: a rectangle of the rank's queries against a rectangle of a K/V block, with
            the causal flag and the window translated to the rectangle's own bottom-right alignment
            (``_plan_pieces``). A step's pieces never overlap; a step may have none (skipped).
step        ring step t: rank r holds the K/V block of rank (r - t) mod W.

[Note: translating a mask to a piece]
A query at absolute position i sees the key at j when i - left <= j <= i + right (left / right from
``window_size``, ``right = 0`` for causal, an unbounded side omitted). flash_attn_func aligns its
masks bottom-right: in a call with Sq queries and Sk keys, local query i' sees local key j' when
i' + off - left' <= j' <= i' + off + right', off = Sk - Sq. For a rectangle whose last query is at
q_end - 1 and last key at k_end - 1 (absolute), the two agree with left' = left + e and
right' = right - e, e = k_end - q_end. Trimming the rectangle first to the keys its queries can see
(k_end <= q_end + right) and to the queries that see one of those keys (q_end <= k_end + left) makes
both >= 0, which the kernels require. A causal piece with e = 0 keeps the kernel's causal flag.

Communication uses torch.distributed's point-to-point ops (``batch_isend_irecv``: NCCL on GPUs, gloo on
the CPU) on the caller's group. At each step the next block's send/recv is posted before the current
block's kernels are launched, and waited for after them, so transfer and compute overlap. Waiting on an
NCCL transfer only orders the current CUDA stream after it: the host never blocks on the GPU.

Not supported: varlen (packed sequences; see docs/context-parallel.md), a key length other than the
query length per rank (cross-attention), dropout, torch.func transforms, DTensor arguments (pass the local
shard). The public functions are marked ``torch.compiler.disable``: a compiled model runs them eagerly
(one graph break each) and compiles the rest.
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import numbers
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import autograd as _autograd  # noqa: F401  (registers triflash::attn_bwd)
from .api import flash_attn_func, validate_qkv
from .kernels.common import last_dim_contiguous
from .kvcache import merge_attn_states
from .validation import check_window, require_bool, require_int, require_tensor

__all__ = ["ring_flash_attn_func", "allgather_flash_attn_func", "simulate_ring_attention", "shard_sequence",
           "unshard_sequence", "gather_sequence", "shard_positions", "rank_work", "ring_steps",
           "benchmark_steps"]

SHARDINGS = ("zigzag", "contiguous")

# Tags keep the two streams of a backward step apart on gloo (NCCL matches by order, which agrees).
_TAG_KV, _TAG_DKV, _TAG_DKV_HOME = 11, 12, 13


# -- validation ----------------------------------------------------------------------------------------

def _check_sharding(sharding) -> str:
    if not isinstance(sharding, str) or sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    return sharding


def _check_local_len(name: str, local_len: int, sharding: str) -> None:
    if sharding == "zigzag" and local_len % 2:
        raise ValueError(f"{name} must hold an even number of tokens per rank with sharding='zigzag' (two "
                         f"chunks of equal length), got seqlen {local_len}; pad the sequence to a multiple of "
                         f"2 * world_size, or use sharding='contiguous'")


def _resolve_group(group):
    """(group, rank in it, its size). Raises when torch.distributed has no process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized; expected a process group (call "
                         "torch.distributed.init_process_group first), got none")
    if group is None:
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group must contain this process (torch.distributed.get_rank(group) >= 0), got a group "
                         "this rank is not a member of")
    return group, rank, dist.get_world_size(group)


def _refuse_dtensor(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if type(t).__name__ == "DTensor":
            raise TypeError(f"{name} must be this rank's plain torch.Tensor shard, got a DTensor: pass "
                            f"{name}.to_local() (a sequence sharded with Shard(1) is sharding='contiguous') and "
                            f"wrap the output with DTensor.from_local")


def _validate(q, k, v, softmax_scale, causal, window_size, sharding, return_lse):
    _refuse_dtensor(q, k, v)
    scale = validate_qkv(q, k, v, "bshd", "softmax_scale", softmax_scale, causal)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k and v must hold as many tokens per rank as q (seqlen {q.shape[1]}; context "
                         f"parallelism splits one self-attention sequence), got seqlen {k.shape[1]}")
    require_bool("return_lse", return_lse)
    window = check_window(window_size, causal)
    _check_local_len("q", q.shape[1], _check_sharding(sharding))
    return scale, window


# -- sharding --------------------------------------------------------------------------------------------

def _segments(sharding: str, rank: int, world: int, local_len: int) -> tuple[tuple[int, int], ...]:
    """The rank's segments (first absolute position, length), in the order the rank stores them."""
    if sharding == "contiguous":
        return ((rank * local_len, local_len),)
    chunk = local_len // 2
    return ((rank * chunk, chunk), ((2 * world - 1 - rank) * chunk, chunk))


@functools.lru_cache(maxsize=64)
def _order(sharding: str, world: int, seqlen: int, device=None) -> torch.Tensor:
    """Absolute positions in rank-major order: entry n of the concatenated shards holds token order[n].
    Built on ``device`` (no host-to-device copy) and cached."""
    local = seqlen // world
    return torch.cat([torch.arange(start, start + n, device=device) for r in range(world)
                      for start, n in _segments(sharding, r, world, local)])


@functools.lru_cache(maxsize=64)
def _inverse_order(sharding: str, world: int, seqlen: int, device=None) -> torch.Tensor:
    return torch.argsort(_order(sharding, world, seqlen, device))


def _check_shardable(name: str, seqlen: int, world: int, sharding: str) -> None:
    parts = 2 * world if sharding == "zigzag" else world
    if seqlen % parts:
        raise ValueError(f"{name} must have a sequence length divisible by {parts} "
                         f"({'2 * ' if sharding == 'zigzag' else ''}world_size, sharding={sharding!r}), got "
                         f"{seqlen}")


def shard_positions(seqlen: int, rank: int, world_size: int, *, sharding: str = "zigzag",
                    device=None) -> torch.Tensor:
    """The absolute positions (int64, [seqlen // world_size]) of the tokens ``rank`` holds, in its
    order: what rotary embeddings / position ids of a sharded sequence must use.

    >>> shard_positions(8, 0, 2)
    tensor([0, 1, 6, 7])
    """
    world = require_int("world_size", world_size, 1)
    _check_sharding(sharding)
    _check_shardable("seqlen", require_int("seqlen", seqlen, 1), world, sharding)
    if not (isinstance(rank, numbers.Integral) and not isinstance(rank, bool) and 0 <= rank < world):
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
    return torch.cat([torch.arange(s, s + n, device=device)
                      for s, n in _segments(sharding, int(rank), world, seqlen // world)])


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, *, sharding: str = "zigzag",
                   dim: int = 1) -> torch.Tensor:
    """The slice of a full sequence ``x`` that ``rank`` of ``world_size`` holds (a new contiguous
    tensor; differentiable). ``dim``: the sequence dimension (1 in [B, S, H, D]).

    >>> x = torch.arange(8).view(1, 8)
    >>> shard_sequence(x, 1, 2).tolist()        # zigzag: chunks 1 and 2 of 4
    [[2, 3, 4, 5]]
    """
    require_tensor("x", x)
    world = require_int("world_size", world_size, 1)
    _check_sharding(sharding)
    if not (isinstance(rank, numbers.Integral) and not isinstance(rank, bool) and 0 <= rank < world):
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
    _check_shardable("x", x.shape[dim], world, sharding)
    local = x.shape[dim] // world
    return torch.cat([x.narrow(dim, s, n) for s, n in _segments(sharding, int(rank), world, local)],
                     dim=dim).contiguous()


def unshard_sequence(shards, *, sharding: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (a list in rank order): the inverse of
    ``shard_sequence``. Differentiable."""
    if not isinstance(shards, (list, tuple)) or not shards or not all(isinstance(t, torch.Tensor) for t in shards):
        raise TypeError(f"shards must be a non-empty list of tensors (one per rank, in rank order), got "
                        f"{type(shards).__name__}")
    _check_sharding(sharding)
    world = len(shards)
    local = shards[0].shape[dim]
    if any(t.shape != shards[0].shape for t in shards):
        raise ValueError(f"shards must all have the same shape, got {[tuple(t.shape) for t in shards]}")
    _check_local_len("shards", local, sharding)
    return _unshard(torch.cat(list(shards), dim=dim), world, sharding, dim)


def _unshard(joined: torch.Tensor, world: int, sharding: str, dim: int) -> torch.Tensor:
    """Rank-major concatenation -> sequence order."""
    if sharding == "contiguous" or world == 1:
        return joined
    return joined.index_select(dim, _inverse_order(sharding, world, joined.shape[dim], joined.device))


def _to_rank_major(full: torch.Tensor, world: int, sharding: str, dim: int) -> torch.Tensor:
    """Sequence order -> rank-major concatenation (the inverse of ``_unshard``)."""
    if sharding == "contiguous" or world == 1:
        return full
    return full.index_select(dim, _order(sharding, world, full.shape[dim], full.device))


def _all_gather(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """out (contiguous, W times x's elements) <- every rank's x, in rank order (flat views: gloo wants
    the output as the inputs' concatenation along dim 0)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out.view(-1), x.contiguous().view(-1), group=group)


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """out <- the sum over ranks of their x's rank-th part (x contiguous, W times out's elements)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out.view(-1), x.view(-1), group=group)


def gather_sequence(x: torch.Tensor, *, group=None, sharding: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """All-gather every rank's shard of a sequence and return the full sequence in order, on every
    rank (not differentiable: for checks, logging and evaluation)."""
    require_tensor("x", x)
    _check_sharding(sharding)
    group, _, world = _resolve_group(group)
    _check_local_len("x", x.shape[dim], sharding)
    moved = x.detach().movedim(dim, 0).contiguous()
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    _all_gather(out, moved, group)
    return _unshard(out, world, sharding, 0).movedim(0, dim)


# -- planning: which pieces each step computes ------------------------------------------------------------

class _Piece(NamedTuple):
    """One kernel call, in the rank's local coordinates: queries [q0, q1) against keys [k0, k1) of the
    block held, with the kernel's own causal flag and window (see [Note: translating a mask])."""
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    window: tuple[int, int]

    @property
    def full(self) -> bool:
        return not self.causal and self.window == (-1, -1)


def _coalesce(segs):
    """Segments adjacent in the sequence (and, being consecutive, in memory) joined into one, with
    their local offsets: ((start, length, local offset), ...)."""
    out, offset = [], 0
    for start, n in segs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n, out[-1][2])
        else:
            out.append((start, n, offset))
        offset += n
    return out


def _classify(qseg, kseg, left, right):
    """The piece of one query segment against one key segment, or None when no query sees any key.
    left / right: absolute bounds (None: unbounded; right = 0 for causal)."""
    (qs, qn, qo), (ks, kn, ko) = qseg, kseg
    q_lo, q_hi, k_lo, k_hi = qs, qs + qn, ks, ks + kn          # half-open absolute ranges
    for _ in range(2):                                          # trim keys, then queries, then again
        if left is not None:
            k_lo = max(k_lo, q_lo - left)
        if right is not None:
            k_hi = min(k_hi, q_hi + right)
        if k_lo >= k_hi:
            return None
        if right is not None:
            q_lo = max(q_lo, k_lo - right)
        if left is not None:
            q_hi = min(q_hi, k_hi + left)
        if q_lo >= q_hi:
            return None
    local = (q_lo - qs + qo, q_hi - qs + qo, k_lo - ks + ko, k_hi - ks + ko)
    sees_all = ((left is None or k_lo >= q_hi - 1 - left) and (right is None or k_hi - 1 <= q_lo + right))
    if sees_all:
        return _Piece(*local, False, (-1, -1))
    e = k_hi - q_hi
    wl = -1 if left is None else left + e
    wr = -1 if right is None else right - e
    if right == 0 and e == 0:
        return _Piece(*local, True, (wl, -1))      # causal=True path (faster kernels when wl == -1)
    return _Piece(*local, False, (wl, wr))


def _join_full(pieces):
    """Merge full (unmasked) pieces that share a key range and touch along the queries, or share a
    query range and touch along the keys: fewer, larger launches."""
    pieces = list(pieces)
    merged = True
    while merged:
        merged = False
        for a in range(len(pieces)):
            for b in range(len(pieces)):
                p, o = pieces[a], pieces[b]
                if a == b or not (p.full and o.full):
                    continue
                if (p.k0, p.k1) == (o.k0, o.k1) and p.q1 == o.q0:
                    joined = _Piece(p.q0, o.q1, p.k0, p.k1, False, (-1, -1))
                elif (p.q0, p.q1) == (o.q0, o.q1) and p.k1 == o.k0:
                    joined = _Piece(p.q0, p.q1, p.k0, o.k1, False, (-1, -1))
                else:
                    continue
                pieces = [x for i, x in enumerate(pieces) if i not in (a, b)] + [joined]
                merged = True
                break
            if merged:
                break
    return sorted(pieces)


def _plan_pieces(q_segs, k_segs, causal: bool, window: tuple[int, int]) -> tuple[_Piece, ...]:
    """The kernel calls that compute queries ``q_segs`` against keys ``k_segs`` (segments as
    ``_segments`` gives them) under causal / window, each rectangle trimmed to what is visible."""
    left = None if window[0] < 0 else window[0]
    right = 0 if causal else (None if window[1] < 0 else window[1])
    qc, kc = _coalesce(q_segs), _coalesce(k_segs)
    q_len, k_len = sum(n for _, n in q_segs), sum(n for _, n in k_segs)
    if left is None and right is None:
        return (_Piece(0, q_len, 0, k_len, False, (-1, -1)),)
    if left is None and right == 0 and tuple(q_segs) == tuple(k_segs):
        # The same ascending positions on both sides: local order is absolute order, so the kernel's
        # causal mask over the whole block is exact (zigzag's diagonal step: two chunks, one launch).
        return (_Piece(0, q_len, 0, k_len, True, (-1, -1)),)
    pieces = [p for qs in qc for ks in kc if (p := _classify(qs, ks, left, right)) is not None]
    return tuple(_join_full(pieces))


@functools.lru_cache(maxsize=4096)
def _step_pieces(sharding: str, world: int, local_len: int, rank: int, step: int, causal: bool,
                 window: tuple[int, int]) -> tuple[_Piece, ...]:
    source = (rank - step) % world
    return _plan_pieces(_segments(sharding, rank, world, local_len), _segments(sharding, source, world, local_len),
                        causal, window)


@functools.lru_cache(maxsize=256)
def _ring_length(sharding: str, world: int, local_len: int, causal: bool, window: tuple[int, int]) -> int:
    """How many ring steps any rank has work in (all ranks agree: a pure function of the plan). Less
    than W only where a window never reaches the blocks that would arrive last."""
    if window == (-1, -1):
        return world
    last = 0
    for rank in range(world):
        for step in range(world - 1, last, -1):
            if _step_pieces(sharding, world, local_len, rank, step, causal, window):
                last = step
                break
    return last + 1


def ring_steps(seqlen: int, world_size: int, *, sharding: str = "zigzag", causal: bool = False,
               window_size=(-1, -1)) -> int:
    """How many ring steps ``ring_flash_attn_func`` runs for a sequence of ``seqlen`` tokens in all
    over ``world_size`` ranks: ``world_size``, or fewer where a window never reaches the farthest
    blocks (contiguous sharding with a left window: 1 + ceil(left / L) steps)."""
    world = require_int("world_size", world_size, 1)
    _check_sharding(sharding)
    _check_shardable("seqlen", require_int("seqlen", seqlen, 1), world, sharding)
    return _ring_length(sharding, world, seqlen // world, causal, check_window(window_size, causal))


def _visible_entries(piece: _Piece, qsegs, ksegs, left, right) -> int:
    """Scores a piece actually needs (visible (query, key) pairs), from absolute positions."""
    def positions(segs, lo, hi):
        return torch.cat([torch.arange(s, s + n) for s, n in segs])[lo:hi]
    i = positions(qsegs, piece.q0, piece.q1)[:, None]
    j = positions(ksegs, piece.k0, piece.k1)[None, :]
    ok = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    if left is not None:
        ok &= j >= i - left
    if right is not None:
        ok &= j <= i + right
    return int(ok.sum())


def rank_work(seqlen: int, world_size: int, *, sharding: str = "zigzag", causal: bool = True,
              window_size=(-1, -1), count: str = "visible") -> torch.Tensor:
    """Each rank's work at each ring step: an int64 tensor [world_size, steps].

    count="visible": (query, key) score entries the rank's pieces need (what the kernels do, up to their
    tile rounding). count="computed": the size of the rectangles launched (queries x keys of each
    piece, masked entries included). The ring's time per step is set by its busiest rank, so a
    balanced sharding has equal entries down each column."""
    if count not in ("visible", "computed"):
        raise ValueError(f"count must be 'visible' or 'computed', got {count!r}")
    world = require_int("world_size", world_size, 1)
    _check_sharding(sharding)
    _check_shardable("seqlen", require_int("seqlen", seqlen, 1), world, sharding)
    window = check_window(window_size, causal)
    local = seqlen // world
    steps = _ring_length(sharding, world, local, causal, window)
    left = None if window[0] < 0 else window[0]
    right = 0 if causal else (None if window[1] < 0 else window[1])
    work = torch.zeros(world, steps, dtype=torch.int64)
    for r in range(world):
        for t in range(steps):
            qsegs = _segments(sharding, r, world, local)
            ksegs = _segments(sharding, (r - t) % world, world, local)
            for p in _step_pieces(sharding, world, local, r, t, causal, window):
                work[r, t] += (_visible_entries(p, qsegs, ksegs, left, right) if count == "visible"
                               else (p.q1 - p.q0) * (p.k1 - p.k0))
    return work


class _Plan(NamedTuple):
    sharding: str
    world: int
    local_len: int
    causal: bool
    window: tuple[int, int]
    scale: float

    @property
    def steps(self) -> int:
        return _ring_length(self.sharding, self.world, self.local_len, self.causal, self.window)

    def pieces(self, rank: int, step: int):
        return _step_pieces(self.sharding, self.world, self.local_len, rank, step, self.causal, self.window)


# -- one rank's passes, as generators -------------------------------------------------------------------
#
# The ring passes are written once, as generators that yield their communication: ``_Post(tensor, offset,
# tag)`` sends ``tensor`` to rank r + offset and receives a tensor like it from rank r - offset, and
# returns a handle at once; ``_Wait(handle)`` returns the received tensor. A driver runs them: over a
# torch.distributed group (``_run_group``), or all W ranks in one process (``_run_loopback``, for tests
# and timing on one GPU), so both run the same code.

class _Post(NamedTuple):
    tensor: torch.Tensor
    offset: int
    tag: int


class _Wait(NamedTuple):
    handle: object


def _accumulate(out_acc, lse_acc, covered, piece, out_p, lse_p):
    """Fold a piece's (out, lse) into the running fp32 state of rows [q0, q1)."""
    rows = slice(piece.q0, piece.q1)
    if not any(a < piece.q1 and piece.q0 < b for a, b in covered):
        out_acc[:, rows] = out_p
        lse_acc[..., rows] = lse_p
    else:
        out, lse = merge_attn_states([out_acc[:, rows], out_p.float()], [lse_acc[..., rows], lse_p])
        out_acc[:, rows] = out
        lse_acc[..., rows] = lse
    covered.append((piece.q0, piece.q1))


def _forward_pieces(pieces, scale, q, kv, out_acc, lse_acc, covered) -> None:
    """Run ``pieces`` of queries q [B, L, Hq, D] against kv [2, B, Lk, Hkv, D]; fold them into the state."""
    for p in pieces:
        out_p, lse_p = flash_attn_func(q[:, p.q0:p.q1], kv[0, :, p.k0:p.k1], kv[1, :, p.k0:p.k1],
                                       softmax_scale=scale, causal=p.causal, window_size=p.window, return_lse=True)
        _accumulate(out_acc, lse_acc, covered, p, out_p, lse_p)


def _backward_pieces(pieces, scale, dout, dlse, q, kv, out, lse, dq, dkv=None):
    """Gradients of ``pieces`` given the *final* out and lse of the rows (so each piece's P is its share
    of the global softmax): dq [B, L, Hq, D] fp32 gets them added in place; dK/dV go into dkv
    [2, B, Lk, Hkv, D] fp32, created when a piece first needs it (returned; None if no piece ran).
    Uses the custom op ``triflash::attn_bwd`` (torch.ops.triflash.attn_bwd)."""
    for p in pieces:
        rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
        dq_p, dk_p, dv_p, _ = torch.ops.triflash.attn_bwd(
            dout[:, rows], q[:, rows], kv[0, :, keys], kv[1, :, keys], out[:, rows], lse[..., rows],
            None if dlse is None else dlse[..., rows], scale, p.causal, False, True, True, *p.window)
        dq[:, rows] += dq_p
        if dkv is None:
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        dkv[0, :, keys] += dk_p
        dkv[1, :, keys] += dv_p
    return dkv


def _ring_forward(plan: _Plan, rank: int, q, kv):
    """One rank's forward. q [B, L, Hq, D]; kv [2, B, L, Hkv, D] (k and v stacked: one transfer).
    Returns (out [B, L, Hq, D] in q's dtype, lse [B, Hq, L] fp32)."""
    batch, local, heads, _ = q.shape
    out_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse_acc = torch.full((batch, heads, local), -math.inf, dtype=torch.float32, device=q.device)
    covered = []
    steps = plan.steps
    for step in range(steps):
        if step + 1 < steps:
            pending = yield _Post(kv, 1, _TAG_KV)       # the next block travels while this one computes
        _forward_pieces(plan.pieces(rank, step), plan.scale, q, kv, out_acc, lse_acc, covered)
        if step + 1 < steps:
            kv = yield _Wait(pending)
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(plan: _Plan, rank: int, dout, dlse, q, kv, out, lse):
    """One rank's backward: the ring again, each K/V block followed one step behind by the fp32
    accumulator of its gradient (dk, dv stacked), which every rank adds its part to and passes on; after
    the last step it goes home. Returns (dq, dk, dv) in the inputs' dtype."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    steps = plan.steps
    acc = pending_acc = None
    for step in range(steps):
        if step + 1 < steps:
            pending_kv = yield _Post(kv, 1, _TAG_KV)
        part = _backward_pieces(plan.pieces(rank, step), plan.scale, dout, dlse, q, kv, out, lse, dq)
        if step == 0:
            acc = part if part is not None else torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        else:
            acc = yield _Wait(pending_acc)              # this block's accumulator, from the previous rank
            if part is not None:
                acc += part
        if step + 1 < steps:
            pending_acc = yield _Post(acc, 1, _TAG_DKV)
            kv = yield _Wait(pending_kv)
    home = -(steps - 1) % plan.world                    # the block held last belongs to rank r - steps + 1
    if home:
        pending_acc = yield _Post(acc, home, _TAG_DKV_HOME)
        acc = yield _Wait(pending_acc)
    return dq.to(q.dtype), acc[0].to(q.dtype), acc[1].to(q.dtype)


# -- drivers ---------------------------------------------------------------------------------------------

class _GroupComm:
    """Runs one rank's generator over a torch.distributed process group."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.peers = [dist.get_global_rank(group, r) for r in range(world)]

    def run(self, gen):
        reply = None
        try:
            while True:
                msg = gen.send(reply)
                if isinstance(msg, _Post):
                    recv = torch.empty_like(msg.tensor)
                    ops = [dist.P2POp(dist.isend, msg.tensor, self.peers[(self.rank + msg.offset) % self.world],
                                      self.group, msg.tag),
                           dist.P2POp(dist.irecv, recv, self.peers[(self.rank - msg.offset) % self.world],
                                      self.group, msg.tag)]
                    reply = (dist.batch_isend_irecv(ops), recv, msg.tensor)
                else:
                    works, recv, _ = msg.handle
                    for work in works:
                        work.wait()
                    reply = recv
        except StopIteration as done:
            return done.value


def _run_loopback(gens):
    """Runs one generator per virtual rank in this process, in lock step: a post is delivered (as a
    copy) to the rank it names; a wait returns once the matching post has been made."""
    world = len(gens)
    mail = collections.defaultdict(collections.deque)            # (dest, source, tag) -> tensors
    results, replies, pending = [None] * world, [None] * world, [None] * world
    live = set(range(world))
    while live:
        progress = False
        for r in sorted(live):
            msg = pending[r]
            if msg is None:
                try:
                    msg = pending[r] = gens[r].send(replies[r])
                except StopIteration as done:
                    results[r] = done.value
                    live.discard(r)
                    progress = True
                    continue
            if isinstance(msg, _Post):
                mail[((r + msg.offset) % world, r, msg.tag)].append(msg.tensor.clone())
                replies[r] = ((r - msg.offset) % world, msg.tag)
            else:
                box = mail[(r, *msg.handle)]
                if not box:
                    continue
                replies[r] = box.popleft()
            pending[r] = None
            progress = True
        if not progress:
            raise RuntimeError("loopback ring: every rank waits for a transfer no rank has posted")
    return results


# -- autograd --------------------------------------------------------------------------------------------

class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, plan):
        kv = torch.stack((k, v))
        out, lse = comm.run(_ring_forward(plan, comm.rank, q, kv))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.plan = comm, plan
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else last_dim_contiguous(dout)
        dq, dk, dv = ctx.comm.run(_ring_backward(ctx.plan, ctx.comm.rank, dout, dlse, q, torch.stack((k, v)),
                                                 out, lse))
        return dq, dk, dv, None, None


class _LoopbackRing(torch.autograd.Function):
    """``simulate_ring_attention``: all W ranks' passes in this process, on full-sequence tensors."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        world, sharding = plan.world, plan.sharding
        qs = [shard_sequence(q, r, world, sharding=sharding) for r in range(world)]
        kvs = [torch.stack((shard_sequence(k, r, world, sharding=sharding),
                            shard_sequence(v, r, world, sharding=sharding))) for r in range(world)]
        results = _run_loopback([_ring_forward(plan, r, qs[r], kvs[r]) for r in range(world)])
        out = unshard_sequence([o for o, _ in results], sharding=sharding)
        lse = unshard_sequence([lse for _, lse in results], sharding=sharding, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        world, sharding = plan.world, plan.sharding
        dout = torch.zeros_like(out) if dout is None else dout

        def cut(t, dim=1):
            return None if t is None else shard_sequence(t, r, world, sharding=sharding, dim=dim)
        gens = []
        for r in range(world):
            kv = torch.stack((cut(k), cut(v)))
            gens.append(_ring_backward(plan, r, cut(dout), cut(dlse, 2), cut(q), kv, cut(out), cut(lse, 2)))
        grads = _run_loopback(gens)
        return (*(unshard_sequence([g[i] for g in grads], sharding=sharding) for i in range(3)), None)


# -- public functions ------------------------------------------------------------------------------------

@torch.compiler.disable
def ring_flash_attn_func(q, k, v, *options, group=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                         sharding="zigzag", return_lse=False):
    """Attention over a sequence split across the ranks of ``group``, K/V passed around the ring.

    Every rank of the group calls it with its own shard (all with the same options and shapes).

    Args:
        q: [batch, L, heads_q, head_dim]: this rank's queries (``shard_sequence`` of the full q).
        k, v: [batch, L, heads_kv, head_dim], this rank's keys and values, same dtype and device; GQA /
            MQA as in ``flash_attn_func`` (only the heads_kv heads travel).
        group: the torch.distributed process group over which the sequence is split (default: the
            world). NCCL for CUDA tensors, gloo for CPU tensors (the interpreter).
        softmax_scale, causal, window_size: as ``flash_attn_func``, applied to absolute positions in
            the full sequence (causal: query i sees key j <= i; a window: i - left <= j <= i + right).
        sharding: how the sequence was split, "zigzag" (default: balanced causal work, L even) or
            "contiguous" (rank r holds tokens [r L, (r + 1) L); best with a window, where it also
            shortens the ring to the blocks the window reaches).
        return_lse: also return lse [batch, heads_q, L] float32 (natural log) of this rank's queries.

    Returns:
        out [batch, L, heads_q, head_dim] in q's dtype for this rank's queries (and lse). Differentiable
        in q, k, v (and through lse): the backward is a second ring, with dK/dV accumulators travelling
        with the K/V blocks.

    Example (each of 2 processes, after ``torch.distributed.init_process_group``)::

        rank, world = dist.get_rank(), dist.get_world_size()
        q_local = shard_sequence(q, rank, world)              # [B, S / world, H, D], zigzag
        out_local = ring_flash_attn_func(q_local, k_local, v_local, causal=True)
        out = gather_sequence(out_local)                      # [B, S, H, D] on every rank
    """
    if options:
        raise TypeError(f"ring_flash_attn_func takes q, k and v by position and every option by keyword, got "
                        f"{len(options)} more positional argument(s)")
    scale, window = _validate(q, k, v, softmax_scale, causal, window_size, sharding, return_lse)
    group, rank, world = _resolve_group(group)
    comm = _GroupComm(group, rank, world)
    plan = _Plan(sharding, world, q.shape[1], causal, window, scale)
    out, lse = _RingAttention.apply(q, k, v, comm, plan)
    return (out, lse) if return_lse else out


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, rank, world, plan):
        kv = _gather_kv(k, v, group, plan.world, plan.sharding)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=torch.float32, device=q.device)
        _forward_pieces(_gather_pieces(plan, rank), plan.scale, q, kv, out, lse, [])
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.rank, ctx.world, ctx.plan = group, rank, world, plan
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, world = ctx.plan, ctx.world
        dout = torch.zeros_like(out) if dout is None else last_dim_contiguous(dout)
        kv = _gather_kv(k, v, ctx.group, plan.world, plan.sharding)     # again: not kept between passes
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        _backward_pieces(_gather_pieces(plan, ctx.rank), plan.scale, dout, dlse, q, kv, out, lse, dq, dkv)
        if world == 1:
            mine = dkv
        else:
            # sequence order -> [W, 2, B, L, Hkv, D] rank-major; each rank gets the sum of its block's parts
            parts = _to_rank_major(dkv, world, plan.sharding, 2)
            parts = parts.unflatten(2, (world, plan.local_len)).movedim(2, 0).contiguous()
            mine = torch.empty(parts.shape[1:], dtype=parts.dtype, device=parts.device)
            _reduce_scatter(mine, parts, ctx.group)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None, None


def _gather_kv(k, v, group, world, sharding):
    """The whole K/V [2, B, S, Hkv, D] in sequence order, from every rank's shard."""
    kv = torch.stack((k, v))
    if world == 1:
        return kv
    parts = kv.new_empty((world, *kv.shape))
    _all_gather(parts, kv, group)
    full = parts.movedim(0, 2).flatten(2, 3)                   # [2, B, W * L, Hkv, D], rank-major
    return _unshard(full, world, sharding, 2)


def _gather_pieces(plan: _Plan, rank: int):
    """A rank's queries against the whole sequence's keys (in order): one piece per query segment."""
    return _plan_pieces(_segments(plan.sharding, rank, plan.world, plan.local_len),
                        ((0, plan.world * plan.local_len),), plan.causal, plan.window)


@torch.compiler.disable
def allgather_flash_attn_func(q, k, v, *options, group=None, softmax_scale=None, causal=False,
                              window_size=(-1, -1), sharding="zigzag", return_lse=False):
    """``ring_flash_attn_func``'s contract, with the whole K/V all-gathered once instead of passed
    around a ring (Llama 3's context parallelism): one collective of (W - 1) / W of K/V per pass, each
    rank's queries against the gathered keys in one or two launches, and the K/V gradients summed home
    by one reduce-scatter (fp32). The gathered K/V ([2, B, S, heads_kv, D]) lives only during each pass.
    Worth it where K/V is small (GQA / MQA with few KV heads) and S is moderate; the gather is not
    overlapped with compute. Same arguments and result as ``ring_flash_attn_func``."""
    if options:
        raise TypeError(f"allgather_flash_attn_func takes q, k and v by position and every option by keyword, "
                        f"got {len(options)} more positional argument(s)")
    scale, window = _validate(q, k, v, softmax_scale, causal, window_size, sharding, return_lse)
    group, rank, world = _resolve_group(group)
    plan = _Plan(sharding, world, q.shape[1], causal, window, scale)
    out, lse = _AllGatherAttention.apply(q, k, v, group, rank, world, plan)
    return (out, lse) if return_lse else out


@torch.compiler.disable
def simulate_ring_attention(q, k, v, *options, world_size, softmax_scale=None, causal=False, window_size=(-1, -1),
                            sharding="zigzag", return_lse=False):
    """The ring of ``ring_flash_attn_func`` with ``world_size`` virtual ranks run one after another in
    this process, on full-sequence tensors [batch, S, heads, head_dim] (S divisible by world_size, or by
    2 * world_size for zigzag): every rank's pieces, merges and gradient accumulators, with the
    transfers replaced by copies. For testing the algorithm on one GPU and for timing its steps; the
    result is the full out (and lse) in sequence order, differentiable."""
    if options:
        raise TypeError(f"simulate_ring_attention takes q, k and v by position and every option by keyword, got "
                        f"{len(options)} more positional argument(s)")
    world = require_int("world_size", world_size, 1)
    scale, window = _validate(q, k, v, softmax_scale, causal, window_size, sharding, return_lse)
    _check_shardable("q", q.shape[1], world, sharding)
    plan = _Plan(sharding, world, q.shape[1] // world, causal, window, scale)
    out, lse = _LoopbackRing.apply(q, k, v, plan)
    return (out, lse) if return_lse else out


# -- timing on one GPU ------------------------------------------------------------------------------------

def benchmark_steps(*, seqlen: int, world_size: int, batch: int = 1, heads: int = 16, heads_kv: int | None = None,
                    head_dim: int = 128, dtype=torch.bfloat16, causal: bool = True, sharding: str = "zigzag",
                    window_size=(-1, -1), backward: bool = False, device="cuda") -> dict:
    """Time, on one GPU, the compute of every ring step of every rank against the dense kernel.

    For each (rank, step) the step's pieces (the same kernel calls ``ring_flash_attn_func`` makes, merges
    included) are timed with ``triton.testing.do_bench``; a step lasts as long as its slowest rank. Returns
    a dict: ``dense_ms`` (flash_attn_func over the full sequence on one GPU), ``steps_ms`` (per step, the
    slowest rank), ``ring_ms`` (their sum: the ring's compute time per rank), ``overhead`` (ring_ms *
    world_size / dense_ms: 1.0 means splitting costs nothing), ``step_bytes`` (the K/V block each step
    sends; the gradient pass sends twice that in fp32 on top), and the transfer times at 900 GB/s (NVLink)
    and 25 GB/s (PCIe) for comparison with the step times. ``backward``: time forward + backward.

    From the shell: ``python -m triflash.distributed --seqlen 32768 --world-size 8 --head-dim 128``.
    """
    import triton.testing

    heads_kv = heads if heads_kv is None else heads_kv
    world = require_int("world_size", world_size, 1)
    _check_shardable("seqlen", seqlen, world, _check_sharding(sharding))
    window = check_window(window_size, causal)
    local = seqlen // world
    scale = head_dim ** -0.5
    plan = _Plan(sharding, world, local, causal, window, scale)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(s, h):
        return torch.randn(batch, s, h, head_dim, device=device, dtype=dtype, generator=gen,
                           requires_grad=backward)
    q, k, v = randn(seqlen, heads), randn(seqlen, heads_kv), randn(seqlen, heads_kv)

    def dense():
        out = flash_attn_func(q, k, v, causal=causal, window_size=window, softmax_scale=scale)
        if backward:
            out.backward(torch.ones_like(out))
    dense_ms = triton.testing.do_bench(dense)

    if backward:
        with torch.no_grad():
            out, lse = simulate_ring_attention(q, k, v, world_size=world, softmax_scale=scale, causal=causal,
                                               window_size=window, sharding=sharding, return_lse=True)
        dout = torch.ones_like(out)
    steps_ms, timed = [], {}            # ranks whose pieces have the same shapes take the same time
    for step in range(plan.steps):
        worst = 0.0
        for rank in range(world):
            pieces = plan.pieces(rank, step)
            shapes = tuple((p.q1 - p.q0, p.k1 - p.k0, p.causal, p.window) for p in pieces)
            if not pieces or shapes in timed:
                worst = max(worst, timed.get(shapes, 0.0))
                continue

            def cut(t, r=rank, dim=1):
                return shard_sequence(t.detach(), r, world, sharding=sharding, dim=dim)
            qr, kvr = cut(q), torch.stack((cut(k, (rank - step) % world), cut(v, (rank - step) % world)))
            grads_of = (cut(dout), cut(out), cut(lse, dim=2)) if backward else None

            def run(pieces=pieces, qr=qr, kvr=kvr, grads_of=grads_of):
                out_acc = torch.zeros(qr.shape, dtype=torch.float32, device=qr.device)
                lse_acc = torch.full((batch, heads, local), -math.inf, device=qr.device)
                _forward_pieces(pieces, scale, qr, kvr, out_acc, lse_acc, [])
                if grads_of is not None:
                    dout_r, out_r, lse_r = grads_of
                    dq = torch.zeros(qr.shape, dtype=torch.float32, device=qr.device)
                    _backward_pieces(pieces, scale, dout_r, None, qr, kvr, out_r, lse_r, dq)
            timed[shapes] = triton.testing.do_bench(run)
            worst = max(worst, timed[shapes])
        steps_ms.append(worst)
    elem = torch.empty((), dtype=dtype).element_size()
    step_bytes = 2 * batch * local * heads_kv * head_dim * elem
    ring_ms = sum(steps_ms)
    return {"dense_ms": dense_ms, "steps_ms": steps_ms, "ring_ms": ring_ms, "overhead": ring_ms * world / dense_ms,
            "step_bytes": step_bytes, "nvlink_ms": step_bytes / 900e9 * 1e3, "pcie_ms": step_bytes / 25e9 * 1e3}


def _main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m triflash.distributed",
                                     description="Time ring attention's per-step compute against the dense "
                                                 "kernel on one GPU (virtual ranks).")
    parser.add_argument("--seqlen", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=None)
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--sharding", choices=SHARDINGS, default="zigzag")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    print(f"# ring steps vs dense, {torch.cuda.get_device_name()}, {args.dtype}, W={args.world_size}, "
          f"{args.sharding}, causal={not args.no_causal}, {'fwd+bwd' if args.backward else 'fwd'}")
    print("| S | D | dense ms | ring ms/rank | x W / dense | slowest step ms | step MB | NVLink ms | PCIe ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in args.head_dim:
        for s in args.seqlen:
            r = benchmark_steps(seqlen=s, world_size=args.world_size, batch=args.batch, heads=args.heads,
                                heads_kv=args.heads_kv, head_dim=d, dtype=dtype, causal=not args.no_causal,
                                sharding=args.sharding, backward=args.backward)
            print(f"| {s} | {d} | {r['dense_ms']:.3f} | {r['ring_ms']:.3f} | {r['overhead']:.2f} | "
                  f"{max(r['steps_ms']):.3f} | {r['step_bytes'] / 1e6:.2f} | {r['nvlink_ms']:.3f} | "
                  f"{r['pcie_ms']:.3f} |")


if __name__ == "__main__":
    _main()

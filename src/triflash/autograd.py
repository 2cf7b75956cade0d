"""Autograd and torch.compile support: the forward and backward as torch.library custom ops.

``triflash::attn_fwd`` and ``triflash::attn_bwd`` are opaque to torch.compile (it does not trace into
Triton launches) but fully described to it: each has a fake (meta) implementation giving output shapes,
and the forward's autograd formula calls the backward op. A model calling triflash therefore compiles
without graph breaks, and ``torch.library.opcheck`` can verify the registrations.

The forward saves only q, k, v, out and lse for the backward: no S x S tensor exists in any pass.

Eager autograd on plain tensors takes a shorter road to the same implementations: ``_EagerAttention``,
a ``torch.autograd.Function``. A custom op's Python autograd wrapper (argument binding, redispatch,
the dynamo guard around it) costs as much host time as the autograd engine itself or more, and at
short sequences that is longer than the kernels take (docs/performance-notes.md#host-cost-per-call). Everything that
must see an op (torch.compile, fake tensors, functorch transforms, tracing, dispatch modes) still
gets ``triflash::attn_fwd``, and a backward that is recorded or watched gets ``triflash::attn_bwd``
(``_gradients``); both roads give bit-identical results. ``__torch_function__`` modes see neither
op on the eager roads (only the public functions), as calls without a gradient never did.

torch.func transforms (``grad``, ``vjp``, ``jacrev``, ``vmap``, nested either way) take a third road,
``_FunctorchAttention``: functorch differentiates only setup_context-style Functions, which a custom
op's autograd wrapper is not. It calls the same ops, with the same formula; the ops' batching rules
fold a vmapped dimension into the batch (one launch). Not supported: forward mode (raises) and
torch.compile around a torch.func transform (Dynamo inlines the Function and fails loudly on it).

Score variants ([Note: score variants] in kernels/common.py): every op takes ``softcap``,
``alibi_slopes`` and ``sinks`` after the window (defaults: none, so callers written before them keep
working). The backward ops return a fourth gradient, dsink ([Hq] float32; empty without sinks):
the sinks are differentiable, the slopes are not.

Both ops take tensors in their caller's layout: ``bhsd=False`` for FlashAttention's [B, S, H, D],
``bhsd=True`` for [B, H, S, D]. They hand [B, S, H, D] views to the launchers and return outputs and
gradients in the caller's layout (custom ops may not return views of their inputs, and a gradient must
have its input's shape).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from .kernels import dispatch, launch
from .kernels.common import ScoreVariant, Varlen


def _bshd(t: Tensor, bhsd: bool) -> Tensor:
    return t.transpose(1, 2) if bhsd else t


def forward_impl(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, bhsd: bool,
                 window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                 alibi_slopes: Tensor | None = None, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Forward on validated inputs. Returns (out in q's layout, lse [B, Hq, Sq] float32).
    window_left / window_right: a local window's bounds (-1: none on that side); softcap,
    alibi_slopes, sinks: the score variants (0 / None: none)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _, lse = dispatch.forward(_bshd(q, bhsd), _bshd(k, bhsd), _bshd(v, bhsd), softmax_scale, causal,
                             out=_bshd(out, bhsd), window=(window_left, window_right),
                             scores=ScoreVariant(softcap, alibi_slopes, sinks))
    return out, lse


def _forward_call(q, k, v, alibi_slopes, sinks, softmax_scale, causal, bhsd, window_left, window_right, softcap):
    """``forward_impl`` with every tensor first (``launch.call`` takes the call's tensors as its inputs)."""
    return forward_impl(q, k, v, softmax_scale, causal, bhsd, window_left, window_right, softcap, alibi_slopes,
                        sinks)


@torch.library.custom_op("triflash::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, bhsd: bool,
             window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
             alibi_slopes: Tensor | None = None, sinks: Tensor | None = None,
             deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """Forward on validated inputs. Returns (out in q's layout, lse [B, Hq, Sq] float32).
    ``deterministic`` is the backward's (the forward always is)."""
    return forward_impl(q, k, v, softmax_scale, causal, bhsd, window_left, window_right, softcap, alibi_slopes,
                        sinks)


def forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, bhsd: bool,
            window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
            sinks: Tensor | None = None, deterministic: bool = False, *, entry=None) -> tuple[Tensor, Tensor]:
    """The forward through the custom op, through ``_EagerAttention`` or ``_FunctorchAttention``, or
    straight to the launcher.

    The op is what torch.compile, torch.export, torch.func transforms, torch.jit.trace and dispatch
    modes (FlopCounterMode, fake tensors, ...) see. Eager autograd on plain tensors needs only an
    autograd node, and a plain eager call that records no graph needs nothing: both skip the op's
    dispatch, whose host time at short sequences is a visible part of every call. ``entry``: the
    call's ``launch.Entry`` (its key's plan), used on the two eager roads."""
    if _has_tangent(q, k, v):
        raise NotImplementedError(_NO_JVP)
    variant = (softcap, alibi_slopes, sinks, deterministic)
    if _needs_op(q, k, v, alibi_slopes, sinks):
        # Under torch.func transforms always the Function: whether a grad transform watches these
        # tensors is not visible from inside a vmap (a batched tensor over a grad-tracking one says
        # requires_grad=False), and the op's own autograd wrapper raises under every grad transform.
        if torch._C._are_functorch_transforms_active() and not torch.compiler.is_compiling():
            return _FunctorchAttention.apply(q, k, v, softmax_scale, causal, bhsd, window_left, window_right,
                                             *variant)
        return attn_fwd(q, k, v, softmax_scale, causal, bhsd, window_left, window_right, *variant)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        call = (softmax_scale, causal, bhsd, window_left, window_right, softcap, alibi_slopes, deterministic, entry)
        # A keyed call holds plain tensors (launch.meta read their storage): no dead functorch
        # wrapper for Function.apply's Python layer to unwrap, so the C++ apply is called directly.
        apply = _EAGER_APPLY if entry is not None and entry.keyed else _EagerAttention.apply
        return apply(q, k, v, sinks, call)
    return launch.call(entry, _forward_call, (q, k, v, alibi_slopes, sinks), softmax_scale, causal, bhsd,
                       window_left, window_right, softcap)


_NO_JVP = ("triflash has no forward-mode derivative (jvp): q, k or v carries a tangent (a dual tensor "
           "of torch.autograd.forward_ad, or torch.func.jvp / jacfwd / hessian); expected plain tensors "
           "(use reverse mode, or PyTorch's scaled_dot_product_attention for jvp)")


def _has_tangent(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a forward-mode AD tangent rides on q, k or v. Neither road has a jvp formula, and
    without this check the output would silently come back without a tangent."""
    if getattr(forward_ad, "_current_level", -1) < 0:       # no dual level open: nothing to unpack
        return False
    return any(forward_ad.unpack_dual(t).tangent is not None for t in (q, k, v))


def _needs_op(q: Tensor, k: Tensor, v: Tensor, *optional: Tensor | None) -> bool:
    if torch.compiler.is_compiling():
        return True
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return True                        # FakeTensor, DTensor, other subclasses
    for t in optional:
        if t is not None and type(t) is not Tensor:
            return True
    if torch._C._are_functorch_transforms_active():
        return True                        # vmap / jvp / grad: batched or dual tensors, no storage
    if torch.jit.is_tracing():
        return True                        # the tracer records ops; a bare kernel launch is invisible
    return _current_dispatch_mode() is not None


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, softmax_scale, causal, bhsd, window_left=-1, window_right=-1, softcap=0.0,
                   alibi_slopes=None, sinks=None, deterministic=False):
    batch, heads, seqlen = (q.shape[0], q.shape[1], q.shape[2]) if bhsd else (q.shape[0], q.shape[2], q.shape[1])
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        q.new_empty((batch, heads, seqlen), dtype=torch.float32)


def _fold(t: Tensor | None, bdim: int | None, size: int) -> Tensor | None:
    """vmap: the vmapped dimension (``bdim``) moved to the front and folded into the batch dimension,
    which is dim 0 of every op argument: [V, B, ...] -> [V * B, ...]. An argument that is not vmapped
    (``bdim`` None) is copied V times (the Hopper path's TMA descriptors take no zero stride), and so
    is one whose vmapped dimension cannot be folded as a view; the launchers need a unit stride on
    the last dimension."""
    if t is None:
        return None
    t = t.movedim(bdim, 0) if bdim is not None else t.unsqueeze(0).expand(size, *t.shape)
    t = t.reshape(size * t.shape[1], *t.shape[2:])
    return t if t.stride(-1) == 1 else t.contiguous()


def _unfold(t: Tensor, size: int) -> Tensor:
    return t.reshape(size, t.shape[0] // size, *t.shape[1:])


def _per_sample(op, n, in_dims, args):
    """vmap by a loop: ``op`` on each sample (every vmapped argument selected at its dimension), the
    results stacked on dim 0 (empty ones, gradients not asked for, passed through unbatched)."""
    results = []
    for i in range(n):
        results.append(op(*(a.select(d, i) if d is not None else a for a, d in zip(args, in_dims))))
    outs = tuple(torch.stack(r) if r[0].numel() else r[0] for r in zip(*results))
    return outs, tuple(0 if r[0].numel() else None for r in zip(*results))


def _variant_dims(in_dims, first: int) -> tuple:
    """in_dims of (alibi_slopes, sinks), the arguments from index ``first + 1`` on (None where absent)."""
    dims = tuple(in_dims) + (None,) * 20
    return dims[first + 1], dims[first + 2]


def _fold_slopes(alibi_slopes, n):
    """Slopes for the folded batch: [Hq] stay, [B, Hq] repeat for each of the n samples."""
    return alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else _fold(alibi_slopes, None, n)


def _attn_fwd_vmap(info, in_dims, q, k, v, softmax_scale, causal, bhsd, window_left=-1, window_right=-1,
                   softcap=0.0, alibi_slopes=None, sinks=None, deterministic=False):
    """torch.func.vmap: one launch over every vmapped sample (folded into the batch), not PyTorch's
    fallback of one call per sample. Slopes or sinks that are vmapped themselves: one call per sample."""
    n = info.batch_size
    args = (q, k, v, softmax_scale, causal, bhsd, window_left, window_right, softcap, alibi_slopes, sinks,
            deterministic)
    if any(d is not None for d in _variant_dims(in_dims, 8)):
        return _per_sample(attn_fwd, n, tuple(in_dims) + (None,) * (len(args) - len(in_dims)), args)
    out, lse = attn_fwd(_fold(q, in_dims[0], n), _fold(k, in_dims[1], n), _fold(v, in_dims[2], n),
                        softmax_scale, causal, bhsd, window_left, window_right, softcap,
                        _fold_slopes(alibi_slopes, n), sinks, deterministic)
    return (_unfold(out, n), _unfold(lse, n)), (0, 0)


attn_fwd.register_vmap(_attn_fwd_vmap)


def _dsink_buffer(lse: Tensor, sinks: Tensor | None) -> Tensor:
    """Where the backward writes dsink: [Hq] float32, or an empty tensor without sinks."""
    return lse.new_empty(sinks.shape if sinks is not None else (0,), dtype=torch.float32)


def backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  dlse: Tensor | None, softmax_scale: float, causal: bool, bhsd: bool, need_dq: bool,
                  need_dkdv: bool, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                  alibi_slopes: Tensor | None = None, sinks: Tensor | None = None, deterministic: bool = False,
                  *, placeholders: bool = True) -> tuple[Tensor | None, ...]:
    """Gradients (dq, dk, dv, dsink) in the inputs' layouts; dsink is [Hq] float32 with sinks. Gradients
    not asked for, and dsink without sinks, come back empty (0 elements) as the op's schema wants, or
    None with ``placeholders=False`` (the eager road: each allocation is host time).
    ``deterministic`` (or ``torch.use_deterministic_algorithms(True)``): bit-reproducible kernels only."""
    def unasked(t):
        return t.new_empty(0) if placeholders else None
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dq else unasked(q)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if need_dkdv else unasked(k)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if need_dkdv else unasked(v)
    dsink = _dsink_buffer(lse, sinks) if sinks is not None or placeholders else None
    dispatch.backward(
        _bshd(dout, bhsd), _bshd(q, bhsd), _bshd(k, bhsd), _bshd(v, bhsd), _bshd(out, bhsd), lse,
        softmax_scale, causal, dlse=dlse,
        dq=_bshd(dq, bhsd) if need_dq else None,
        dk=_bshd(dk, bhsd) if need_dkdv else None,
        dv=_bshd(dv, bhsd) if need_dkdv else None,
        need_dq=need_dq, need_dkdv=need_dkdv, window=(window_left, window_right),
        scores=ScoreVariant(softcap, alibi_slopes, sinks), dsink=dsink,
        deterministic=deterministic or torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv, dsink


def _eager_backward_call(dout, q, k, v, out, lse, dlse, alibi_slopes, sinks, *args, deterministic=False):
    """``backward_impl`` with every tensor first (``launch.call``'s inputs) and no placeholder
    allocations; ``args``: the scalars from softmax_scale to softcap, then deterministic."""
    *args, deterministic = args
    return backward_impl(dout, q, k, v, out, lse, dlse, *args, alibi_slopes, sinks, deterministic,
                         placeholders=False)


@torch.library.custom_op("triflash::attn_bwd", mutates_args=())
def attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             dlse: Tensor | None, softmax_scale: float, causal: bool, bhsd: bool, need_dq: bool,
             need_dkdv: bool, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
             alibi_slopes: Tensor | None = None, sinks: Tensor | None = None,
             deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv, dsink) in the inputs' layouts. Gradients not asked for come back empty
    (0 elements); dsink is [Hq] float32 with sinks, else empty."""
    return backward_impl(dout, q, k, v, out, lse, dlse, softmax_scale, causal, bhsd, need_dq, need_dkdv,
                         window_left, window_right, softcap, alibi_slopes, sinks, deterministic)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal, bhsd, need_dq, need_dkdv,
                   window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                   deterministic=False):
    def like(t, needed):
        return torch.empty_like(t, memory_format=torch.contiguous_format) if needed else t.new_empty(0)
    return like(q, need_dq), like(k, need_dkdv), like(v, need_dkdv), _dsink_buffer(lse, sinks)


def _attn_bwd_vmap(info, in_dims, dout, q, k, v, out, lse, dlse, softmax_scale, causal, bhsd, need_dq,
                   need_dkdv, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                   deterministic=False):
    """torch.func.vmap of the backward (vmap over grad: per-sample gradients), in one launch; with
    sinks (their gradient sums over the batch, so a folded batch would mix the samples') or vmapped
    slopes, one call per sample."""
    n = info.batch_size
    args = (dout, q, k, v, out, lse, dlse, softmax_scale, causal, bhsd, need_dq, need_dkdv, window_left,
            window_right, softcap, alibi_slopes, sinks, deterministic)
    if sinks is not None or _variant_dims(in_dims, 14)[0] is not None:
        return _per_sample(attn_bwd, n, tuple(in_dims) + (None,) * (len(args) - len(in_dims)), args)
    folded = [_fold(t, d, n) for t, d in zip((dout, q, k, v, out, lse, dlse), in_dims)]
    grads = attn_bwd(*folded, softmax_scale, causal, bhsd, need_dq, need_dkdv, window_left, window_right,
                     softcap, _fold_slopes(alibi_slopes, n), None, deterministic)
    needed = (need_dq, need_dkdv, need_dkdv, False)   # gradients not asked for are empty, not batched
    return (tuple(_unfold(g, n) if need else g for g, need in zip(grads, needed)),
            tuple(0 if need else None for need in needed))


attn_bwd.register_vmap(_attn_bwd_vmap)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, bhsd, *rest = inputs
    out, lse = output
    _save(ctx, q, k, v, out, lse, softmax_scale, causal, bhsd, *rest)


# Where the sinks are among the inputs of attn_fwd / _EagerAttention / _FunctorchAttention (q, k, v,
# softmax_scale, causal, bhsd, window_left, window_right, softcap, alibi_slopes, sinks, deterministic)
# and of varlen_fwd: the index of their gradient.
_SINKS_INPUT = 10
_VARLEN_SINKS_INPUT = 13
_EAGER_SINKS_INPUT = 3          # _EagerAttention's inputs: q, k, v, sinks, call


def _save(ctx, q, k, v, out, lse, softmax_scale, causal, bhsd, window_left=-1, window_right=-1, softcap=0.0,
          alibi_slopes=None, sinks=None, deterministic=False):
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks)
    ctx.softmax_scale, ctx.causal, ctx.bhsd = softmax_scale, causal, bhsd
    ctx.window = (window_left, window_right)
    ctx.softcap, ctx.deterministic = softcap, deterministic
    # An unused output's gradient arrives as None instead of a tensor of zeros: the usual loss never
    # touches lse, and its dlse would otherwise be read (as zeros) by every backward.
    ctx.set_materialize_grads(False)


def _gradients(ctx, dout, dlse, backward_fn):
    """The autograd formula of the op and the torch.func road: ``backward_fn`` (the op, attn_bwd, or
    a Function around it) computes the gradients autograd asks for. The eager road
    (``_EagerAttention.backward``) takes the op too when its backward is recorded (create_graph=True:
    the op says it has no derivative, so a second backward raises instead of silently leaving out the
    second-order terms, which torch's once_differentiable would do here) or watched (compiled
    autograd traces it with fake tensors; a dispatch mode around the backward alone)."""
    q, k, v, out, lse, alibi_slopes, sinks = ctx.saved_tensors   # once: each read runs the saved-tensor hooks

    def run(dout, need_dq, need_dkdv):
        args = (ctx.softmax_scale, ctx.causal, ctx.bhsd, need_dq, need_dkdv, *ctx.window, ctx.softcap)
        return backward_fn(dout, q, k, v, out, lse, dlse, *args, alibi_slopes, sinks, ctx.deterministic)
    return _input_grads(ctx, dout, out, run, _SINKS_INPUT)


def _backward_entry(entry, inputs, need_dq: bool, need_dkdv: bool, deterministic: bool, as_saved: bool = False):
    """The backward's call-cache entry under the forward's, keyed on which gradients are asked for
    and every tensor it reads: saved tensors can come back from hooks with other strides. With
    ``as_saved`` (no hooks at the forward) they are the forward's own tensors, which the forward's
    key and plan fix, and dout and dlse are the only new ones."""
    if entry.sub is None:
        entry.sub = {}
    dout, dlse = inputs[0], inputs[6]
    if type(dout) is not Tensor or type(dlse) not in (Tensor, type(None)):
        return None
    if as_saved:
        key = (need_dq, need_dkdv, deterministic, launch.meta(dout), None if dlse is None else launch.meta(dlse))
    else:
        key = (need_dq, need_dkdv, deterministic, *(None if t is None else launch.meta(t) for t in inputs))
    sub = entry.sub.get(key)
    if sub is None:
        if len(entry.sub) >= 64:
            entry.sub.clear()
        sub = entry.sub[key] = launch.Entry(keyed=True)
    return sub


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _no_saved_tensor_hooks() -> bool:
    """No default saved-tensor hooks are set (torch.autograd.graph.saved_tensors_hooks; False where
    this torch cannot tell)."""
    return _TOP_HOOKS is not None and _TOP_HOOKS(False) is None


def _eager_apply(cls):
    """``cls.apply`` without Function.apply's Python layer (argument binding for setup_context
    Functions, functorch checks, unwrapping dead functorch wrappers), where this torch has the
    C++ apply it calls; else ``cls.apply``."""
    raw = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
    return raw.__get__(None, cls) if hasattr(raw, "__get__") else cls.apply


def _input_grads(ctx, dout, out, run, sinks_input: int):
    """The formula's frame, shared by the dense and the packed ops: only the gradients autograd asks
    for are computed (``run(dout, need_dq, need_dkdv)`` -> (dq, dk, dv, dsink)), a loss on lse alone
    gets a zero dout, dsink goes to input ``sinks_input``, and every other input gets None."""
    need_dq = ctx.needs_input_grad[0]
    need_dkdv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    if dout is None:                       # a loss on lse alone
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = run(dout, need_dq, need_dkdv)
    grads = [dq if need_dq else None,
             dk if ctx.needs_input_grad[1] else None,
             dv if ctx.needs_input_grad[2] else None] + [None] * (len(ctx.needs_input_grad) - 3)
    if len(ctx.needs_input_grad) > sinks_input and ctx.needs_input_grad[sinks_input]:
        grads[sinks_input] = dsink
    return tuple(grads)


def _backward(ctx, dout, dlse):
    return _gradients(ctx, dout, dlse, attn_bwd)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The op's forward and autograd formula as a plain autograd.Function (see the module docstring).

    Host time per call is what it is for: the scalars travel as one tuple (``call``: softmax_scale,
    causal, bhsd, window_left, window_right, softcap, alibi_slopes, deterministic, entry), since autograd
    handles each
    input of a Function (and each gradient slot of its backward) one by one; the forward takes ``ctx``
    itself (the setup_context style binds arguments through inspect.signature on every call); and
    the backward replays from a plan keyed on dout alone when the saved tensors come back as they
    were saved (no saved-tensor hooks at the forward)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call):
        softmax_scale, causal, bhsd, window_left, window_right, softcap, alibi_slopes, _, entry = call
        out, lse = launch.call(entry, _forward_call, (q, k, v, alibi_slopes, sinks), softmax_scale, causal, bhsd,
                               window_left, window_right, softcap)
        ctx.save_for_backward(q, k, v, out, lse, sinks, alibi_slopes)   # alibi_slopes: version-checked
        ctx.call = call
        # Saved tensors come back as saved unless a pack hook is set (save_on_cpu, checkpointing):
        # then the backward's plan key needs only dout's metadata.
        ctx.as_saved = entry is not None and entry.keyed and _no_saved_tensor_hooks()
        ctx.set_materialize_grads(False)       # as _save: an unused lse's gradient stays None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks, alibi_slopes = ctx.saved_tensors
        softmax_scale, causal, bhsd, window_left, window_right, softcap, _, deterministic, entry = ctx.call
        # As PyTorch's own ops: the global switch, read when the backward runs, overrides the argument.
        deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
        watched = torch.is_grad_enabled() or _needs_op(q, k, v, alibi_slopes, sinks)

        def run(dout, need_dq, need_dkdv):
            args = (softmax_scale, causal, bhsd, need_dq, need_dkdv, window_left, window_right, softcap)
            inputs = (dout, q, k, v, out, lse, dlse, alibi_slopes, sinks)
            if watched:                        # recorded (create_graph) or watched: the op (see _gradients)
                return attn_bwd(*inputs[:7], *args, alibi_slopes, sinks, deterministic)
            sub = None if entry is None else _backward_entry(entry, inputs, need_dq, need_dkdv, deterministic,
                                                            ctx.as_saved)
            return launch.call(sub, _eager_backward_call, inputs, *args, deterministic)
        return _input_grads(ctx, dout, out, run, _EAGER_SINKS_INPUT)


_EAGER_APPLY = _eager_apply(_EagerAttention)


class _FunctorchAttention(torch.autograd.Function):
    """The road under torch.func transforms (``grad``, ``vjp``, ``jacrev``, ``vmap``, nested either
    way). functorch differentiates only autograd.Functions written in the setup_context style, which
    a custom op's own autograd wrapper is not (it raises under ``torch.func.grad``). So this Function
    carries the same autograd formula, and each pass calls the ops. Under ``vmap``,
    ``generate_vmap_rule`` runs the Function's passes on the batched tensors, and the ops they call
    reach their batching rules (``_attn_fwd_vmap`` / ``_attn_bwd_vmap``). Forward mode (``jvp``,
    ``jacfwd``, ``hessian``) raises."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, softmax_scale, causal, bhsd, window_left=-1, window_right=-1, softcap=0.0,
                alibi_slopes=None, sinks=None, deterministic=False):
        return attn_fwd(q, k, v, softmax_scale, causal, bhsd, window_left, window_right, softcap, alibi_slopes,
                        sinks, deterministic)

    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, dout, dlse):
        return _gradients(ctx, dout, dlse, _FunctorchBackward.apply)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(_NO_JVP)


class _FunctorchBackward(torch.autograd.Function):
    """``attn_bwd`` inside ``_FunctorchAttention.backward``. torch.func.grad runs backward passes with
    the graph recorded (so that transforms nest), and the op's own autograd wrapper raises there, even
    for a first derivative. This Function records a node instead, whose own backward says plainly
    that there is no second derivative (``grad(grad(f))``), rather than returning one without the
    attention's terms."""

    generate_vmap_rule = True

    @staticmethod
    def forward(dout, q, k, v, out, lse, dlse, softmax_scale, causal, bhsd, need_dq, need_dkdv,
                window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None, deterministic=False):
        return attn_bwd(dout, q, k, v, out, lse, dlse, softmax_scale, causal, bhsd, need_dq, need_dkdv,
                        window_left, window_right, softcap, alibi_slopes, sinks, deterministic)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "triflash's attention has no second derivative: a gradient of its gradient (for example "
            "torch.func.grad(torch.func.grad(f))) was asked for; expected first derivatives only")


# -- packed variable-length batches (flash_attn_varlen_func) ------------------------------------------
#
# Their own pair of ops: q / out [total_q, Hq, D], k / v [total_k, Hkv, D], lse [Hq, total_q], and the
# cu_seqlens that cut them into sequences. Eager autograd goes through the op's own autograd wrapper
# (packed batches are long: the op's host time does not show), as do torch.compile and dispatch modes;
# a plain eager call with no gradient goes straight to the launcher. There is no vmap rule and no
# torch.func road: under a torch.func transform the op raises.

def varlen_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
                window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                alibi_slopes: Tensor | None = None, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Forward on validated packed sequences. Returns (out [total_q, Hq, D], lse [Hq, total_q])."""
    return dispatch.forward(q, k, v, softmax_scale, causal,
                           varlen=Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                           window=(window_left, window_right), scores=ScoreVariant(softcap, alibi_slopes, sinks))


def _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, *args):
    """``varlen_impl`` with every tensor first (``launch.call``'s inputs); ``args``: the scalars from
    max_seqlen_q to softcap."""
    return varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, alibi_slopes, sinks)


@torch.library.custom_op("triflash::varlen_fwd", mutates_args=())
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
               window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
               alibi_slopes: Tensor | None = None, sinks: Tensor | None = None,
               deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """Forward on validated packed sequences. Returns (out [total_q, Hq, D], lse [Hq, total_q]).
    ``deterministic`` is the backward's."""
    return varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       window_left, window_right, softcap, alibi_slopes, sinks)


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                     deterministic=False):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


@torch.library.custom_op("triflash::varlen_bwd", mutates_args=())
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None,
               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
               softmax_scale: float, causal: bool, need_dq: bool, need_dkdv: bool,
               window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
               alibi_slopes: Tensor | None = None, sinks: Tensor | None = None,
               deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv, dsink) of packed sequences. Gradients not asked for come back empty; dsink
    is [Hq] float32 with sinks, else empty. ``deterministic`` as backward_impl's."""
    dsink = _dsink_buffer(lse, sinks)
    dq, dk, dv = dispatch.backward(
        dout, q, k, v, out, lse, softmax_scale, causal, dlse=dlse, need_dq=need_dq, need_dkdv=need_dkdv,
        varlen=Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        window=(window_left, window_right), scores=ScoreVariant(softcap, alibi_slopes, sinks), dsink=dsink,
        deterministic=deterministic or torch.are_deterministic_algorithms_enabled())
    return (dq if need_dq else q.new_empty(0), dk if need_dkdv else k.new_empty(0),
            dv if need_dkdv else v.new_empty(0), dsink)


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, need_dq, need_dkdv, window_left=-1, window_right=-1, softcap=0.0,
                     alibi_slopes=None, sinks=None, deterministic=False):
    def like(t, needed):
        return torch.empty_like(t, memory_format=torch.contiguous_format) if needed else t.new_empty(0)
    return like(q, need_dq), like(k, need_dkdv), like(v, need_dkdv), _dsink_buffer(lse, sinks)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
     window_right, softcap, alibi_slopes, sinks, deterministic) = _with_defaults(
         inputs, (-1, -1, 0.0, None, None, False))
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.window = (window_left, window_right)
    ctx.softmax_scale, ctx.causal, ctx.softcap, ctx.deterministic = softmax_scale, causal, softcap, deterministic
    ctx.set_materialize_grads(False)        # as _save: an unused lse's gradient stays None


def _with_defaults(inputs, defaults):
    """inputs with the trailing ``defaults`` filled in where they were not passed."""
    inputs = tuple(inputs)
    missing = len(defaults) - (len(inputs) - 9)
    return inputs + tuple(defaults[len(defaults) - missing:]) if missing > 0 else inputs


def _varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks = ctx.saved_tensors
    return _input_grads(ctx, dout, out, lambda dout, need_dq, need_dkdv: varlen_bwd(
        dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens, ctx.softmax_scale,
        ctx.causal, need_dq, need_dkdv, *ctx.window, ctx.softcap, alibi_slopes, sinks, ctx.deterministic),
        _VARLEN_SINKS_INPUT)


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def varlen_forward(q: Tensor, k: Tensor, v: Tensor, varlen: Varlen, softmax_scale: float,
                   causal: bool, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   alibi_slopes: Tensor | None = None, sinks: Tensor | None = None, deterministic: bool = False, *,
                   entry=None) -> tuple[Tensor, Tensor]:
    """The packed forward through the op where autograd, torch.compile or a dispatch mode needs one,
    else straight to the launcher (through ``entry``'s plan)."""
    if _has_tangent(q, k, v):
        raise NotImplementedError(_NO_JVP)
    if torch._C._are_functorch_transforms_active() and not torch.compiler.is_compiling():
        raise NotImplementedError(
            "flash_attn_varlen_func does not support torch.func transforms (grad, vjp, vmap, ...): "
            "expected plain tensors; torch.autograd (loss.backward(), torch.autograd.grad) works, and "
            "flash_attn_func supports the transforms")
    if _needs_op(q, k, v, alibi_slopes, sinks) or (torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad))):
        return varlen_fwd(q, k, v, *varlen, softmax_scale, causal, *window, softcap, alibi_slopes, sinks,
                          deterministic)
    return launch.call(entry, _varlen_call, (q, k, v, varlen.cu_seqlens_q, varlen.cu_seqlens_k, alibi_slopes, sinks),
                       varlen.max_seqlen_q, varlen.max_seqlen_k, softmax_scale, causal, *window, softcap)

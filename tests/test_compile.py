"""torch.compile and torch.library registration of the custom ops."""

import pytest
import torch
from conftest import ON_GPU
from torch.utils._python_dispatch import TorchDispatchMode

import triflash
import triflash.autograd  # noqa: F401  (registers torch.ops.triflash.*)

# On the CPU the kernels run in Triton's interpreter; aot_eager still traces the whole model through
# AOTAutograd (fake tensors, the custom ops' registrations, the joint forward/backward graph) without
# generating C++ for the surrounding PyTorch ops. On the GPU the default Inductor backend runs.
BACKEND = "inductor" if ON_GPU else "aot_eager"


class TinyAttention(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, self.heads + 2 * self.kv_heads, self.head_dim).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=2)
        out = triflash.flash_attn_func(q, k, v, causal=True)
        return self.proj(out.reshape(b, s, -1))


@pytest.mark.parametrize("dtype", [torch.float32])
def test_compiled_model_matches_eager_without_graph_breaks(device, dtype):
    torch._dynamo.reset()
    model = TinyAttention(64, 4, 2).to(device=device, dtype=dtype)
    x = torch.randn(2, 40, 64, device=device, dtype=dtype, requires_grad=True)
    compiled = torch.compile(model, backend=BACKEND, fullgraph=True)   # fullgraph: a break would raise
    out_c, grads_c = _loss_step(compiled, model, x)
    out_e, grads_e = _loss_step(model, model, x)
    _assert_compiled_like_eager(out_c, grads_c, out_e, grads_e)


# The backward's paths, forced, each with the kernels it must launch (the custom op's backward under
# AOTAutograd takes the same dispatch as eager autograd).
BACKWARD_PATHS = {
    "triton": ["_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"],
    "atomic": ["_bwd_preprocess_kernel+zero_dq", "_bwd_dkdv_kernel+atomic_dq", "_bwd_dq_convert_kernel"],
    "single": ["_bwd_dkdv_kernel+single"],
}


@pytest.mark.parametrize("path", list(BACKWARD_PATHS))
def test_compiled_model_on_each_backward_path(device, launched, path):
    """fullgraph compile with the deterministic Triton backward, the atomic-dQ one and the single
    launch: the compiled step's gradients are the eager step's (bit for bit on the CPU; on the GPU
    within Inductor's summation tolerance, atomic dQ's order included)."""
    from triflash.kernels import dispatch

    torch._dynamo.reset()
    model = TinyAttention(64, 4, 2).to(device=device, dtype=torch.float32)
    x = torch.randn(2, 40, 64, device=device, dtype=torch.float32, requires_grad=True)

    def backward_kernels():
        names = [n for n in launched if "bwd" in n]
        launched.clear()
        return names
    with dispatch.force(backward=path):
        compiled = torch.compile(model, backend=BACKEND, fullgraph=True)
        out_c, grads_c = _loss_step(compiled, model, x)
        assert backward_kernels() == BACKWARD_PATHS[path]
        out_e, grads_e = _loss_step(model, model, x)
        assert backward_kernels() == BACKWARD_PATHS[path]
    _assert_compiled_like_eager(out_c, grads_c, out_e, grads_e)


def _loss_step(fn, model, x):
    """out = fn(x) and the gradients of mean(out ** 2) for the model's parameters and x (cleared
    afterwards). out is cloned: a CUDA-graph replay would overwrite its memory."""
    out = fn(x).clone()
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    return out, grads


def _assert_compiled_like_eager(out_c, grads_c, out_e, grads_e):
    """On the CPU aot_eager runs the same eager kernels in the same order: bit-identical; on the GPU
    Inductor's own kernels around triflash's op: ``_assert_inductor_close``."""
    if not ON_GPU:
        assert torch.equal(out_c, out_e)
        assert all(torch.equal(gc, ge) for gc, ge in zip(grads_c, grads_e))
    else:
        _assert_inductor_close(out_c, grads_c, out_e, grads_e)


def _assert_inductor_close(out_c, grads_c, out_e, grads_e):
    """Inductor generates its own kernels for the projections and the loss (fused, other fp32
    summation orders); triflash's op is the same call in both. A few fp32 ulps of the sums."""
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-5)


def test_dynamo_sees_one_graph(device):
    torch._dynamo.reset()
    model = TinyAttention(32, 2, 1).to(device)
    explanation = torch._dynamo.explain(model)(torch.randn(1, 16, 32, device=device))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


@pytest.mark.parametrize("bhsd", [False, True], ids=["bshd", "bhsd"])
def test_opcheck_forward(device, bhsd):
    shape_q, shape_kv = ((2, 3, 20, 32), (2, 1, 24, 32)) if bhsd else ((2, 20, 3, 32), (2, 24, 1, 32))
    q = torch.randn(*shape_q, device=device, dtype=torch.float16, requires_grad=True)
    k = torch.randn(*shape_kv, device=device, dtype=torch.float16, requires_grad=True)
    v = torch.randn(*shape_kv, device=device, dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(torch.ops.triflash.attn_fwd.default, (q, k, v, 32 ** -0.5, True, bhsd))


def test_opcheck_with_a_window(device):
    """The ops' window arguments (window_left, window_right) through the registrations."""
    q = torch.randn(1, 20, 2, 32, device=device, dtype=torch.float16, requires_grad=True)
    k = torch.randn(1, 24, 1, 32, device=device, dtype=torch.float16, requires_grad=True)
    v = torch.randn(1, 24, 1, 32, device=device, dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(torch.ops.triflash.attn_fwd.default, (q, k, v, 0.2, False, False, 5, 3))
    out, lse = torch.ops.triflash.attn_fwd(q.detach(), k.detach(), v.detach(), 0.2, True, False, 7, 0)
    torch.library.opcheck(torch.ops.triflash.attn_bwd.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, None, 0.2, True,
                           False, True, True, 7, 0))


def test_opcheck_backward(device):
    q = torch.randn(1, 20, 2, 32, device=device, dtype=torch.float16)
    k = torch.randn(1, 24, 2, 32, device=device, dtype=torch.float16)
    v = torch.randn(1, 24, 2, 32, device=device, dtype=torch.float16)
    out, lse = torch.ops.triflash.attn_fwd(q, k, v, 0.2, False, False)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.triflash.attn_bwd.default,
                          (dout, q, k, v, out, lse, None, 0.2, False, False, True, True))


class _OpRecorder(TorchDispatchMode):
    """A dispatch mode that records every op it sees."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_plain_eager_calls_skip_the_op_but_dispatch_modes_see_it(device, monkeypatch):
    """A call that records no graph goes straight to the launcher, and eager autograd through an
    autograd.Function (less host time per call, bit-identical gradients); a call that torch.compile or
    a dispatch mode must see goes through triflash::attn_fwd."""
    through_op = []
    real_op = triflash.autograd.attn_fwd

    def counting_op(*args):
        through_op.append(args)
        return real_op(*args)

    monkeypatch.setattr(triflash.autograd, "attn_fwd", counting_op)
    q = torch.randn(1, 20, 2, 32, device=device, dtype=torch.float16)
    k = torch.randn(1, 24, 2, 32, device=device, dtype=torch.float16)
    v = torch.randn(1, 24, 2, 32, device=device, dtype=torch.float16)

    direct = triflash.flash_attn_func(q, k, v, causal=True)
    assert len(through_op) == 0
    assert torch.equal(direct, real_op(q, k, v, 32 ** -0.5, True, False)[0])

    with torch.no_grad():
        triflash.flash_attn_func(q.requires_grad_(), k, v)
    assert len(through_op) == 0                      # requires_grad, but no graph is recorded
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert len(through_op) == 0 and type(out.grad_fn).__name__ == "_EagerAttentionBackward"
    assert torch.equal(out.detach(), direct)
    op_out, op_lse = real_op(q, k, v, 32 ** -0.5, True, False)
    assert op_out.grad_fn is not None and len(through_op) == 0
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    assert torch.equal(torch.autograd.grad((out, lse), q, (dout, dlse))[0],
                       torch.autograd.grad((op_out, op_lse), q, (dout, dlse))[0])
    k, v = k.clone().requires_grad_(), v.clone().requires_grad_()
    out = triflash.flash_attn_func(q, k, v)
    op_out, _ = real_op(q, k, v, 32 ** -0.5, False, False)
    for eager, by_op in zip(torch.autograd.grad(out, (q, k, v), dout),
                            torch.autograd.grad(op_out, (q, k, v), dout)):
        assert torch.equal(eager, by_op)
    with pytest.raises(RuntimeError, match="no autograd formula"):    # no second derivative, as the op
        g = torch.autograd.grad(triflash.flash_attn_func(q, k, v).float().sum(), q, create_graph=True)
        g[0].float().sum().backward()
    k, v = k.detach(), v.detach()

    with torch.no_grad(), _OpRecorder() as recorder:
        triflash.attention(q.detach().transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert len(through_op) == 1
    assert torch.ops.triflash.attn_fwd.default in recorder.ops


def test_a_backward_watched_on_its_own_goes_through_the_op(device):
    """The forward ran eagerly (no op), the backward is watched: a dispatch mode around it sees
    triflash::attn_bwd, and compiled autograd traces it (fake tensors) as one op, with eager's result."""
    from torch._dynamo import compiled_autograd

    q = torch.randn(1, 20, 2, 32, device=device, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(1, 24, 2, 32, device=device, dtype=torch.float16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn(1, 20, 2, 32, device=device, dtype=torch.float16)
    expected = torch.autograd.grad(triflash.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    out = triflash.flash_attn_func(q, k, v, causal=True)
    with _OpRecorder() as recorder:
        watched = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.ops.triflash.attn_bwd.default in recorder.ops
    assert all(torch.equal(a, b) for a, b in zip(watched, expected))

    torch._dynamo.reset()
    out = triflash.flash_attn_func(q, k, v, causal=True)
    with compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
        out.backward(dout)
    assert all(torch.equal(t.grad, e) for t, e in zip((q, k, v), expected))


def test_forward_mode_ad_raises_instead_of_dropping_the_tangent(device):
    import torch.autograd.forward_ad as fwAD

    q = torch.randn(1, 20, 2, 32, device=device, dtype=torch.float16)
    k, v = (torch.randn(1, 24, 2, 32, device=device, dtype=torch.float16) for _ in range(2))
    with fwAD.dual_level():
        triflash.flash_attn_func(q, k, v)                    # no tangent anywhere: runs
        dual = fwAD.make_dual(k, torch.randn_like(k))
        with pytest.raises(NotImplementedError, match="forward-mode derivative"):
            triflash.flash_attn_func(q, dual, v)
        with pytest.raises(NotImplementedError, match="forward-mode derivative"):
            triflash.attention(q.transpose(1, 2), dual.transpose(1, 2), v.transpose(1, 2))


def _count_launches(monkeypatch, name):
    """Count the calls of triflash.autograd's forward_impl or backward_impl (one per launch of the
    op's kernels): PyTorch's vmap fallback would call the op once per sample."""
    calls = []
    real = getattr(triflash.autograd, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triflash.autograd, name, counted)
    return calls


# torch.jit is deprecated, and tracing warns about the argument checks' shape comparisons (constants
# in a trace, as they should be): the warnings are torch's, about what this test does on purpose.
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated", "ignore::torch.jit.TracerWarning")
def test_vmap_and_jit_trace_go_through_the_op(device, monkeypatch):
    """torch.func.vmap hands batched tensors without storage, and torch.jit.trace records only ops:
    both must take the custom op, never the bare launch. vmap goes through the op's batching rule
    (one launch, the samples folded into the batch), not PyTorch's per-sample fallback."""
    q = torch.randn(3, 1, 12, 2, 16, device=device, dtype=torch.float16)
    k = torch.randn(1, 10, 2, 16, device=device, dtype=torch.float16)
    v = torch.randn(1, 10, 2, 16, device=device, dtype=torch.float16)
    launches = _count_launches(monkeypatch, "forward_impl")
    batched = torch.func.vmap(lambda x: triflash.flash_attn_func(x, k, v, causal=True))(q)
    # k and v vmapped instead, over their third dimension, in SDPA's [B, H, S, D] layout; q shared.
    kv = torch.randn(1, 2, 4, 10, 16, device=device, dtype=torch.float16)
    qh = q[0].transpose(1, 2)
    by_kv = torch.func.vmap(lambda kk: triflash.attention(qh, kk, kk * 0.5), in_dims=2)(kv)
    assert len(launches) == 2                     # one launch per vmap, not one per sample
    looped = torch.stack([triflash.flash_attn_func(x, k, v, causal=True) for x in q])
    assert torch.equal(batched, looped)
    looped_kv = torch.stack([triflash.attention(qh, kv[:, :, i], kv[:, :, i] * 0.5) for i in range(4)])
    assert by_kv.shape == looped_kv.shape and torch.equal(by_kv, looped_kv)

    traced = torch.jit.trace(lambda x: triflash.flash_attn_func(x, k, v), (q[0],), check_trace=False)
    assert "triflash::attn_fwd" in str(traced.graph)
    assert torch.equal(traced(q[1]), triflash.flash_attn_func(q[1], k, v))


@pytest.mark.parametrize("api", ["flash_attn_func", "attention"])
def test_torch_func_grad_matches_autograd(device, api, monkeypatch):
    """torch.func.grad / vjp (functorch's reverse mode) give the gradients that loss.backward() gives,
    bit for bit (the same kernels), for q, k and v at once, GQA and causal; vmap over grad gives each
    sample's own gradient. The custom op's autograd wrapper alone raises under torch.func.grad."""
    gen = torch.Generator(device=device).manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float16, generator=gen)

    q, k, v = randn(2, 40, 4, 32), randn(2, 33, 2, 32), randn(2, 33, 2, 32)
    if api == "attention":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    dout = randn(*q.shape)

    def loss(q, k, v):
        fn = triflash.flash_attn_func if api == "flash_attn_func" else triflash.attention
        return (fn(q, k, v, causal=True).float() * dout.float()).sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*leaves).backward()
    for name, got, leaf in zip("qkv", grads, leaves):
        assert got.shape == leaf.shape and torch.equal(got, leaf.grad), name

    out, vjp_fn = torch.func.vjp(lambda x: triflash.flash_attn_func(x, k, v) if api == "flash_attn_func"
                                 else triflash.attention(x, k, v), q)
    (dq,) = vjp_fn(torch.ones_like(out))
    leaf = q.clone().requires_grad_()
    (triflash.flash_attn_func(leaf, k, v) if api == "flash_attn_func"
     else triflash.attention(leaf, k, v)).backward(torch.ones_like(out))
    assert torch.equal(dq, leaf.grad)

    samples = torch.stack([q, q.flip(0) * 0.5])
    forwards = _count_launches(monkeypatch, "forward_impl")
    backwards = _count_launches(monkeypatch, "backward_impl")
    per_sample = torch.func.vmap(torch.func.grad(lambda x: loss(x, k, v)))(samples)
    assert len(forwards) == 1 and len(backwards) == 1       # both samples in one launch each
    for i in range(2):
        assert torch.equal(per_sample[i], torch.func.grad(lambda x: loss(x, k, v))(samples[i]))


def test_torch_func_grad_of_vmap(device, monkeypatch):
    """grad / vjp of a function that vmaps triflash inside: inside the vmap a tensor watched by the
    grad transform does not say requires_grad, and the op's own autograd wrapper raised there. The
    result equals loss.backward() through a Python loop over the samples, in one launch each way."""
    gen = torch.Generator(device=device).manual_seed(5)
    q = torch.randn(3, 2, 6, 2, 16, device=device, dtype=torch.float16, generator=gen)
    k = torch.randn(2, 5, 1, 16, device=device, dtype=torch.float16, generator=gen)
    v = torch.randn(2, 5, 1, 16, device=device, dtype=torch.float16, generator=gen)
    dout = torch.randn(q.shape, device=device, dtype=torch.float16, generator=gen)

    def loss(x):
        out = torch.func.vmap(lambda y: triflash.flash_attn_func(y, k, v, causal=True))(x)
        return (out.float() * dout.float()).sum()

    forwards = _count_launches(monkeypatch, "forward_impl")
    got = torch.func.grad(loss)(q)
    assert len(forwards) == 1
    leaf = q.clone().requires_grad_()
    torch.stack([triflash.flash_attn_func(y, k, v, causal=True) for y in leaf]).backward(dout)
    assert torch.equal(got, leaf.grad)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian"])
def test_torch_func_forward_mode_raises(device, transform):
    """No forward-mode derivative: every forward-mode transform says so in triflash's words."""
    q, k, v = (torch.randn(1, 4, 2, 16, device=device, dtype=torch.float32) for _ in range(3))
    f = (lambda x: triflash.flash_attn_func(x, k, v).sum()) if transform == "hessian" else \
        (lambda x: triflash.flash_attn_func(x, k, v))
    with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
        if transform == "jvp":
            torch.func.jvp(f, (q,), (torch.ones_like(q),))
        else:
            getattr(torch.func, transform)(f)(q)


def test_torch_func_second_derivative_raises(device):
    """grad of grad has no formula: it raises and names the problem instead of returning a second
    derivative without the attention's terms."""
    q, k, v = (torch.randn(1, 16, 2, 16, device=device, dtype=torch.float16) for _ in range(3))

    def first(x):
        return torch.func.grad(lambda y: triflash.flash_attn_func(y, k, v).float().sum())(x).float().sum()

    with pytest.raises(NotImplementedError, match="no second derivative"):
        torch.func.grad(first)(q)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("seqlen,head_dim", [(512, 128), (4096, 64)])
def test_training_step_replays_in_a_cuda_graph(seqlen, head_dim):
    """A forward and backward captured in a CUDA graph (no host sync, nothing allocated outside the
    graph's pool) replay to the eager results, bit for bit (the kernels are deterministic), also
    after the inputs change in place. On sm_90 both take the Gluon dK/dV kernel; 512 x 128 its Gluon
    dQ kernel too, 4096 x 64 the Triton dQ kernel."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float16, generator=gen)

    q = randn(2, seqlen, 4, head_dim).requires_grad_()
    k, v = (randn(2, seqlen, 2, head_dim).requires_grad_() for _ in range(2))
    dout = randn(2, seqlen, 4, head_dim)

    def step():
        out = triflash.flash_attn_func(q, k, v, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()                      # compile the kernels, warm the allocator
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(randn(*t.shape))
        graph.replay()
        eager = step()
        for name, replayed, expected in zip(("out", "dq", "dk", "dv"), captured, eager):
            assert torch.equal(replayed, expected), name


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_reduce_overhead_compile_matches_eager():
    """torch.compile's CUDA-graph mode around a model that calls triflash: every step after the
    recording replays the graph, and outputs and gradients match eager."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    torch._dynamo.reset()
    counters.clear()
    model = TinyAttention(64, 4, 2).to(device="cuda")
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):                  # warm-up, recording, then replays
        x = torch.randn(2, 40, 64, device="cuda", requires_grad=True)
        out_c, grads_c = _loss_step(compiled, model, x)
        out_e, grads_e = _loss_step(model, model, x)
        _assert_inductor_close(out_c, grads_c, out_e, grads_e)
    # Inductor falls back to plain launches, with only a warning, where it cannot capture (a host
    # sync, an unsupported op): the graphs must really have been recorded.
    assert counters["inductor"]["cudagraph_skips"] == 0
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and sum(len(nodes) for nodes in manager.roots.values()) >= 1

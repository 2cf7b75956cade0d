"""Call plans (``triflash.kernels.launch``): a repeated call replays its recorded launches.

A replay must launch exactly what the plain path launches: every kernel family gives bit-identical
results through its plan (here under the interpreter, and on a GPU with the Triton and the Gluon
kernels the choosers pick), keys never let one call shape reuse another's plan, every check still
fires on a cached key, and no public call synchronises with the GPU.
"""

import pytest
import torch
from conftest import ON_GPU
from helpers import assert_raises_naming

import triflash
from triflash import kvcache
from triflash.kernels import launch

HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
F16 = torch.float16


def _replays() -> int:
    return sum(p.replays for p in launch.plans())


def _same(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
        assert torch.equal(a, b), f"replay differs from the plain path by {(a.float() - b.float()).abs().max()}"


def _assert_replays_like_plain(call, make):
    """``call(*make())`` through a plan equals the plain path bit for bit, on the recording's inputs
    and on fresh ones of the same key."""
    launch.clear_plans()
    launch.LAST_FAILURE = None
    first, second = make(), make()
    launch.ENABLED = False
    try:
        want_first, want_second = call(*first), call(*second)
    finally:
        launch.ENABLED = True
    before = _replays()
    _same(call(*first), want_first)                  # recorded (RECORD_AT = 1 in the tests)
    assert launch.LAST_FAILURE is None, launch.LAST_FAILURE
    _same(call(*second), want_second)                # replayed
    _same(call(*first), want_first)
    assert _replays() >= before + 2, "the repeated calls did not replay a plan"


def _qkv(b, s, hq, hkv, d, dtype=F16, sk=None, grad=False, device="cpu"):
    q = torch.randn(b, s, hq, d, dtype=dtype, device=device)
    k, v = (torch.randn(b, sk or s, hkv, d, dtype=dtype, device=device) for _ in range(2))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


# (id, B, S, Hq, Hkv, D, dtype, kwargs): the interpreter's Triton kernels on the CPU; on sm_90 these
# shapes also reach the Gluon forward (D 64/128 fp16, S >= 512) and backward.
DENSE = [
    ("causal-gqa", 2, 70, 4, 2, 32, F16, dict(causal=True)),
    ("fp32-sk", 1, 33, 2, 1, 40, torch.float32, dict(causal=False)),
    ("window", 1, 90, 2, 2, 16, F16, dict(window_size=(20, 5))),
    ("lse", 1, 40, 2, 2, 16, torch.float32, dict(causal=True, return_lse=True)),
]
if ON_GPU:
    DENSE += [
        ("triton-d64-causal", 1, 128, 8, 8, 64, F16, dict(causal=True)),
        ("gluon-d128", 2, 512, 16, 16, 128, F16, dict(causal=True)),
        ("gluon-d64-3wg", 2, 1024, 8, 8, 64, F16, dict(causal=False)),
        ("gluon-d64-snake", 1, 2048, 8, 2, 64, torch.bfloat16, dict(causal=True)),
        ("gluon-d64-dq", 1, 4096, 4, 4, 64, F16, dict(causal=True)),
    ]


@pytest.mark.parametrize("case", DENSE, ids=[c[0] for c in DENSE])
def test_forward_replays_like_plain(device, case):
    _, b, s, hq, hkv, d, dtype, kw = case
    _assert_replays_like_plain(lambda q, k, v: triflash.flash_attn_func(q, k, v, **kw),
                               lambda: _qkv(b, s, hq, hkv, d, dtype, device=device))


@pytest.mark.parametrize("case", DENSE, ids=[c[0] for c in DENSE])
def test_backward_replays_like_plain(device, case):
    _, b, s, hq, hkv, d, dtype, kw = case
    kw = {key: value for key, value in kw.items() if key != "return_lse"}

    def call(q, k, v, dout):
        return torch.autograd.grad(triflash.flash_attn_func(q, k, v, **kw), (q, k, v), dout)

    def make():
        q, k, v = _qkv(b, s, hq, hkv, d, dtype, grad=True, device=device)
        return q, k, v, torch.randn_like(q)
    _assert_replays_like_plain(call, make)


# Score variants as call inputs (new slope and sink tensors per call): ALiBi [B, Hq] and sinks, whose
# default route on sm_90 at head dim 128 is the Gluon forward and backward.
VARIANT_CASES = [("variants", 2, 70, 4, 2, 32)] + ([("gluon-variants-d128", 2, 512, 8, 2, 128)] if ON_GPU else [])


@pytest.mark.parametrize("case", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_score_variants_replay_like_plain(device, case):
    _, b, s, hq, hkv, d = case

    def call(q, k, v, slopes, sinks, dout):
        out = triflash.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, sinks=sinks)
        return (out, *torch.autograd.grad(out, (q, k, v, sinks), dout))

    def make():
        q, k, v = _qkv(b, s, hq, hkv, d, grad=True, device=device)
        slopes = torch.rand(b, hq, device=device) * 0.5
        sinks = torch.randn(hq, device=device, requires_grad=True)
        return q, k, v, slopes, sinks, torch.randn_like(q)
    _assert_replays_like_plain(call, make)


def test_partial_gradients_replay_like_plain(device):
    """Only dK and dV asked for: the backward's empty dq slot comes back empty through the plan."""
    def call(q, k, v, dout):
        return torch.autograd.grad(triflash.flash_attn_func(q, k, v, causal=True), (k, v), dout)

    def make():
        q = torch.randn(1, 48, 2, 32, dtype=F16, device=device)
        k, v = (torch.randn(1, 48, 2, 32, dtype=F16, device=device, requires_grad=True) for _ in range(2))
        return q, k, v, torch.randn_like(q)
    _assert_replays_like_plain(call, make)


def _restrided(t):
    """t's values in a tensor of other strides (heads outermost), as a saved-tensor hook may return."""
    if t.dim() != 4:
        return t.clone()
    return torch.empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=t.dtype,
                       device=t.device).transpose(1, 2).copy_(t)


def test_backward_after_saved_tensor_hooks_replays_like_plain(device):
    """Saved tensors that come back from a hook with other strides key their own backward plan: the
    short key (dout alone) serves only backwards whose forward ran without hooks. Both kinds of call
    on one forward shape, interleaved, each equal to the plain path."""
    def call(q, k, v, dout, hooked):
        if not hooked:
            return torch.autograd.grad(triflash.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, _restrided):
            out = triflash.flash_attn_func(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    def make():
        q, k, v = _qkv(2, 40, 4, 2, 32, grad=True, device=device)
        return q, k, v, torch.randn_like(q)
    launch.clear_plans()
    cases = [make() for _ in range(2)]
    launch.ENABLED = False
    try:
        want = {(i, h): call(*c, h) for i, c in enumerate(cases) for h in (False, True)}
    finally:
        launch.ENABLED = True
    before = _replays()
    for _ in range(3):
        for h in (False, True, False):
            for i, c in enumerate(cases):
                _same(call(*c, h), want[i, h])
    assert _replays() >= before + 6, "the repeated calls did not replay a plan"


def test_eager_backward_allocates_only_the_gradients_it_returns(device):
    """The eager backward's plan allocates the gradients asked for and the row statistics, and no
    empty placeholders (each allocation is host time on every call)."""
    launch.clear_plans()
    q, k, v = _qkv(1, 32, 4, 2, 32, grad=True, device=device)
    q.requires_grad_(False)
    dout = torch.randn_like(q)
    for _ in range(3):
        torch.autograd.grad(triflash.flash_attn_func(q, k, v, causal=True), (k, v), dout)
    backward = [p for p in launch.plans() if any(a[0] == tuple(k.shape) for a in p.allocs)]
    assert backward, "no backward plan was recorded"
    for plan in backward:
        sizes = [a[0] for a in plan.allocs]
        assert all(0 not in size and size != (0,) for size in sizes), f"placeholder allocations: {sizes}"
        assert tuple(q.shape) not in sizes, f"a dq buffer nobody asked for: {sizes}"


def test_bhsd_layout_replays_like_plain(device):
    _assert_replays_like_plain(
        lambda q, k, v: triflash.attention(q, k, v, causal=True),
        lambda: tuple(t.transpose(1, 2) for t in _qkv(1, 50, 2, 2, 32, device=device)))


def test_varlen_replays_like_plain(device):
    cu = torch.tensor([0, 7, 7, 60, 77], dtype=torch.int32, device=device)

    def call(q, k, v):
        return triflash.flash_attn_varlen_func(q, k, v, cu, cu, 53, 53, causal=True, return_lse=True)

    def make():
        return (torch.randn(77, 4, 32, dtype=F16, device=device),
                *(torch.randn(77, 2, 32, dtype=F16, device=device) for _ in range(2)))
    _assert_replays_like_plain(call, make)


DECODE = [("contiguous", None, 0), ("contiguous-1split", None, 1), ("paged16", 16, 0), ("paged5", 5, 3)]
if ON_GPU:
    DECODE += [("long-gluon", None, 0)]


@pytest.mark.parametrize("case", DECODE, ids=[c[0] for c in DECODE])
def test_decode_replays_like_plain(device, case):
    name, page, splits = case
    b, s, hq, hkv, d = (1, 8192, 32, 8, 128) if name == "long-gluon" else (2, 100, 4, 2, 32)
    lengths = torch.tensor([s, 37][:b], dtype=torch.int32, device=device)

    def make():
        q = torch.randn(b, 1, hq, d, dtype=F16, device=device)
        kc, vc = (torch.randn(b, s, hkv, d, dtype=F16, device=device) for _ in range(2))
        if page is None:
            return q, kc, vc, None
        pages = b * -(-s // page)
        kp, vp = (torch.randn(pages, page, hkv, d, dtype=F16, device=device) for _ in range(2))
        table = torch.randperm(pages, device=device).to(torch.int32).view(b, -1)
        return q, kp, vp, table

    def call(q, kc, vc, table):
        return kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=table,
                                               num_splits=splits, return_lse=True)
    _assert_replays_like_plain(call, make)


def test_merge_replays_like_plain(device):
    _assert_replays_like_plain(
        triflash.merge_attn_states,
        lambda: (torch.randn(3, 2, 5, 4, 16, device=device), torch.randn(3, 2, 4, 5, device=device)))


# -- keys ---------------------------------------------------------------------------------------------

def test_keys_separate_strides_alignment_and_dtype(device):
    """Calls that differ only in strides, pointer alignment or dtype each get their own entry, and
    each result equals the plain path's."""
    base = torch.randn(1, 40, 4, 33, dtype=F16, device=device)
    q = base[..., :32]                                    # strided rows
    q_dense = q.contiguous()
    q_offset = base.flatten()[1:1 + q_dense.numel()].view(q_dense.shape)   # 2-byte aligned
    k, v = _qkv(1, 40, 4, 4, 32, device=device)[1:]
    for _ in range(2):
        outs = [triflash.flash_attn_func(x, k, v, causal=True) for x in (q, q_dense, q_offset)]
        outs.append(triflash.flash_attn_func(q_dense.float(), k.float(), v.float(), causal=True))
    launch.ENABLED = False
    try:
        plain = [triflash.flash_attn_func(x, k, v, causal=True) for x in (q, q_dense, q_offset)]
        plain.append(triflash.flash_attn_func(q_dense.float(), k.float(), v.float(), causal=True))
    finally:
        launch.ENABLED = True
    for got, want in zip(outs, plain):
        _same(got, want)
    keys = [key for key in triflash.api._DENSE if key[1][0] == q.shape]
    assert len(keys) >= 4


def test_cached_keys_still_refuse_bad_arguments(device):
    """A key seen before must not let a look-alike argument through: 1 for True, (1, 0) for
    (True, 0), a list window, a tensor scale."""
    q, k, v = _qkv(1, 20, 2, 2, 16, device=device)
    f = triflash.flash_attn_func
    for _ in range(2):
        f(q, k, v, causal=True)
        f(q, k, v, window_size=(1, 0))
        f(q, k, v, softmax_scale=1.0)
    assert_raises_naming(TypeError, ["causal", "bool", "int"], f, q, k, v, causal=1)
    assert_raises_naming(TypeError, ["window_size"], f, q, k, v, window_size=(True, 0))
    assert_raises_naming(TypeError, ["softmax_scale"], f, q, k, v, softmax_scale=True)
    assert_raises_naming(TypeError, ["softmax_scale"], f, q, k, v, softmax_scale=torch.tensor(1.0))
    assert_raises_naming(ValueError, ["softmax_scale"], f, q, k, v, softmax_scale=float("nan"))
    out = f(q, k, v, window_size=[1, 0])                  # a list: valid, validated every call
    _same(out, f(q, k, v, window_size=(1, 0)))


def test_aliased_inputs_replay_only_when_aliased_again(device):
    """cu_seqlens_q is cu_seqlens_k when recorded: a later call with two different tensors of the
    same key must not read the second through the first one's pointer."""
    q = torch.randn(30, 2, 16, dtype=F16, device=device)
    k, v = (torch.randn(30, 2, 16, dtype=F16, device=device) for _ in range(2))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device=device)
    f = triflash.flash_attn_varlen_func
    for _ in range(2):
        f(q, k, v, cu, cu, 20, 20, causal=True)
    other_k = torch.tensor([0, 20, 30], dtype=torch.int32, device=device)
    got = f(q, k, v, cu, other_k, 20, 20, causal=True)
    launch.ENABLED = False
    try:
        want = f(q, k, v, cu, other_k, 20, 20, causal=True)
    finally:
        launch.ENABLED = True
    _same(got, want)


def test_a_copy_inside_the_call_is_not_replayed(device):
    """A call whose path copies an input (an expanded dout here) is not recorded as a plan: the
    recording names the torch operation, and the results still equal the plain path."""
    q, k, v = _qkv(1, 24, 2, 2, 16, grad=True, device=device)
    launch.clear_plans()
    launch.LAST_FAILURE = None
    for _ in range(2):
        out = triflash.flash_attn_func(q, k, v)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert launch.LAST_FAILURE is not None and "clone" in launch.LAST_FAILURE
    launch.ENABLED = False
    try:
        _same(grads, torch.autograd.grad(triflash.flash_attn_func(q, k, v).sum(), (q, k, v)))
    finally:
        launch.ENABLED = True


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_keys_separate_devices():
    """The same shapes on two GPUs: each device's call runs its own plan, on its own device."""
    outs = []
    for dev in ("cuda:0", "cuda:1", "cuda:0", "cuda:1"):
        torch.manual_seed(0)
        q, k, v = _qkv(1, 64, 2, 2, 64, device=dev)
        outs.append(triflash.flash_attn_func(q, k, v, causal=True))
    for i, j in ((0, 2), (1, 3)):
        assert outs[i].device == outs[j].device
        _same(outs[i], outs[j])
    _same(outs[0].cpu(), outs[1].cpu())


# -- no synchronisation -------------------------------------------------------------------------------

@pytest.mark.skipif(not ON_GPU, reason="synchronisations are a GPU matter")
def test_no_public_call_synchronises():
    """Every public function, first and repeated calls, under torch.cuda.set_sync_debug_mode('error')
    (any device->host synchronisation in PyTorch raises)."""
    dev = "cuda"
    q, k, v = _qkv(2, 256, 8, 2, 64, grad=True, device=dev)
    qp = torch.randn(40, 4, 64, dtype=F16, device=dev, requires_grad=True)
    kp, vp = (torch.randn(40, 2, 64, dtype=F16, device=dev, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 15, 40], dtype=torch.int32, device=dev)
    dq = torch.randn(1, 1, 8, 64, dtype=F16, device=dev)
    cache = [torch.randn(1, 64, 2, 64, dtype=F16, device=dev) for _ in range(2)]
    pages = [torch.randn(8, 16, 2, 64, dtype=F16, device=dev) for _ in range(2)]
    table = torch.arange(8, dtype=torch.int32, device=dev).view(1, 8)
    lengths = torch.tensor([40], dtype=torch.int32, device=dev)
    new = torch.randn(1, 1, 2, 64, dtype=F16, device=dev)
    parts = (torch.randn(2, 1, 3, 4, 64, device=dev), torch.randn(2, 1, 4, 3, device=dev))

    def every_call():
        out = triflash.flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        triflash.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        out = triflash.flash_attn_varlen_func(qp, kp, vp, cu, cu, 25, 25, causal=True)
        torch.autograd.grad(out, (qp, kp, vp), torch.ones_like(out))
        with torch.no_grad():
            triflash.flash_attn_with_kvcache(dq, *cache, cache_seqlens=lengths)
            triflash.flash_attn_with_kvcache(dq, *pages, cache_seqlens=lengths, block_table=table)
            triflash.flash_attn_with_kvcache(dq, *cache, k=new, v=new, cache_seqlens=lengths)
            triflash.flash_attn_with_kvcache(dq, *cache, cache_seqlens=30)
        triflash.merge_attn_states(*parts)

    every_call()                                   # compiles outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            every_call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_plans_keep_no_tensor_of_the_recorded_call_alive(device):
    """A plan holds shapes and offsets, not the recording's tensors: once the caller drops them,
    they are freed."""
    import gc
    import weakref

    launch.clear_plans()
    q, k, v = _qkv(1, 30, 2, 2, 16, device=device)
    out = triflash.flash_attn_func(q, k, v, causal=True)
    assert any(True for _ in launch.plans())
    refs = [weakref.ref(t) for t in (q, k, v, out)]
    del q, k, v, out
    gc.collect()
    assert all(r() is None for r in refs)

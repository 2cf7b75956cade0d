"""What CUDA graphs save on a short training step: eager, torch.compile, and torch.compile with CUDA
graphs (``mode="reduce-overhead"``), for triflash and SDPA's cuDNN backend side by side.

Why: at short sequences a step through triflash is bound by host time, 4-5x cuDNN's (runs 41-42 in
docs/performance-notes.md), and the README points to reduce-overhead for that. This measures it.

The step: ``loss = (attn(q, k, v).float() * w).sum(); loss.backward()`` with q, k, v leaf tensors
(fp16, [B, S, H, D] for triflash; SDPA gets the same data as [B, H, S, D] views) and a fixed random
w. Per (shape, provider, mode): warm-up steps (compiling, recording graphs), then a check that the
gradients equal the eager run's of the same provider to within 1e-3 of their largest magnitude (a
wrong configuration is reported, never timed), then wall-clock time per step: ``steps`` steps with
one synchronize at the end, the least of ``repeats`` such loops. That is the host's time where the
host binds and the GPU's where the GPU binds: what a training loop sees.

    PYTHONPATH=src python3 scripts/gpu_graph_step.py [--shapes B,H,S,D,causal|full ...]
        [--out FILE.json]
    TRITON_INTERPRET=1 PYTHONPATH=src python scripts/gpu_graph_step.py --smoke   (CPU: code paths only)
"""

import argparse
import json
import sys
import time

import torch

import triflash

SHAPES = ["2,8,1024,64,causal", "2,4,4096,128,causal", "8,16,1024,128,full"]
MODES = ("eager", "compile", "reduce-overhead")


def parse_shape(text: str):
    *dims, mode = text.split(",")
    b, h, s, d = (int(x) for x in dims)
    if mode not in ("causal", "full"):
        raise ValueError(f"shape {text!r}: expected B,H,S,D,causal|full")
    return b, h, s, d, mode == "causal"


def attention_fn(provider: str, causal: bool):
    if provider == "triflash":
        return lambda q, k, v: triflash.flash_attn_func(q, k, v, causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)
    return sdpa


def make_step(provider, mode, causal, q, k, v, w, backend):
    attn = attention_fn(provider, causal)

    def loss_fn(q, k, v, w):
        return (attn(q, k, v).float() * w).sum()

    if mode == "compile":
        loss_fn = torch.compile(loss_fn, backend=backend, fullgraph=True)
    elif mode == "reduce-overhead":
        loss_fn = torch.compile(loss_fn, mode="reduce-overhead", fullgraph=True)

    def step():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        for t in (q, k, v):
            t.grad = None
        loss_fn(q, k, v, w).backward()
    return step


def time_steps(step, steps: int, repeats: int, cuda: bool) -> float:
    """Least over ``repeats`` of the wall time of ``steps`` steps, in µs per step."""
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / steps * 1e6)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default="graph_step.json")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the code paths: one tiny shape, eager and aot_eager, triflash only")
    a = ap.parse_args(argv)
    cuda = not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if a.smoke:
        shapes, providers, modes, backend = [(1, 2, 40, 16, True)], ["triflash"], ("eager", "compile"), "aot_eager"
        a.steps, a.repeats, a.warmup = 2, 1, 1
    else:
        shapes = [parse_shape(s) for s in a.shapes]
        providers, modes, backend = ["triflash", "sdpa-cudnn"], MODES, "inductor"
        print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
              f"{__import__('triton').__version__}", flush=True)
    rows = []
    for b, h, s, d, causal in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        dtype = torch.float16 if cuda else torch.float32
        base = [torch.randn(b, s, h, d, device=device, dtype=dtype, generator=gen) for _ in range(3)]
        w = torch.randn(b, s, h, d, device=device, dtype=torch.float32, generator=gen)
        for provider in providers:
            reference = None
            for mode in modes:
                torch._dynamo.reset()
                q, k, v = (t.clone().requires_grad_() for t in base)
                row = dict(shape=[b, h, s, d], causal=causal, provider=provider, mode=mode)
                try:
                    step = make_step(provider, mode, causal, q, k, v, w, backend)
                    for _ in range(a.warmup):
                        step()
                    grads = [t.grad.clone() for t in (q, k, v)]
                    if reference is None:
                        reference = grads
                    err = max(((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
                              for g, r in zip(grads, reference))
                    row["rel_err_vs_eager"] = err
                    if err > 1e-3:
                        row["status"] = f"WRONG: gradients differ from eager by {err:.1e} (relative)"
                    else:
                        row["us_per_step"] = time_steps(step, a.steps, a.repeats, cuda)
                        row["status"] = "ok"
                except Exception as exc:  # noqa: BLE001
                    row["status"] = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    print("\n| B,H,S,D | mask | provider | " + " | ".join(f"{m} µs/step" for m in modes) + " |")
    print("|---|---|---|" + "---|" * len(modes))
    for b, h, s, d, causal in shapes:
        for provider in providers:
            cells = []
            for mode in modes:
                r = next(r for r in rows if r["shape"] == [b, h, s, d] and r["causal"] == causal
                         and r["provider"] == provider and r["mode"] == mode)
                cells.append(f"{r['us_per_step']:.0f}" if r.get("us_per_step") else r["status"][:40])
            print(f"| {b},{h},{s},{d} | {'causal' if causal else 'full'} | {provider} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

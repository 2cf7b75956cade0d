"""The ``triflash bench`` command: arguments, FLOP convention, checking, outputs, plots, no-GPU path.

Timings in these tests come from a fake timer (GPU numbers cannot be measured here); every number
they produce is made up and only exercises the plumbing. The real timer is triton's do_bench.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import triflash
from triflash.bench import cli
from triflash.bench import workloads as W
from triflash.bench.checking import make_decode_case, make_dense_case, reference_forward_backward
from triflash.bench.decode import SdpaDecode, TriflashKVCache
from triflash.bench.interpreter import interpreter_blocker, report_without_gpu
from triflash.bench.providers import FlashAttn2, Naive, Provider, Sdpa, Triflash, TriflashVarlen
from triflash.bench.report import markdown, write_json
from triflash.bench.runner import Result, add_speedups, run_all
from triflash.reference import attention_ref, flash_attn_ref, naive_attention

REPO = Path(__file__).resolve().parents[1]
FAKE_ENV = {"gpu": "FAKE-GPU (test, made-up numbers)", "compute_capability": "0.0", "multiprocessors": 0,
            "gpu_memory_gib": 0, "driver": "none", "cuda": None, "torch": torch.__version__,
            "triton": "-", "triflash": triflash.__version__, "python": "-"}


class FakeTimer:
    """Calls fn once (like a real timer would) and returns made-up (median, p20, p80) in ms."""

    def __init__(self, ms=1.0):
        self.ms, self.calls = ms, 0

    def __call__(self, fn):
        fn()
        self.calls += 1
        return self.ms, 0.9 * self.ms, 1.1 * self.ms


def small(mode="fwd", causal=False, **kw):
    shape = dict(batch=1, heads=2, heads_kv=2, seqlen_q=64, seqlen_k=64, head_dim=32, dtype="fp16")
    shape.update(kw)
    return W.Workload(mode=mode, causal=causal, **shape)


def by_provider(results):
    return {r.provider: r for r in results}


# --------------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------------

def test_defaults_are_the_seed_workload():
    args = cli.parse_args([])
    assert args.mode == "fwd" and args.dtype == "fp16"
    assert args.workloads == [W.Workload("fwd", 4, 16, 16, 4096, 4096, 64, "fp16", causal)
                              for causal in (False, True)]
    assert args.provider_names == cli.provider_names("fwd", defaults_only=True)
    assert {"triflash", "naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "fa2", "fa3",
            "fa4", "flashinfer"} == set(args.provider_names)
    # Opt-in: named, it runs (in table order, after triflash).
    assert cli.parse_args(["--providers", "sdpa-cudnn,triflash-varlen,triflash"]).provider_names == [
        "triflash", "triflash-varlen", "sdpa-cudnn"]
    assert args.out == Path("bench-out") and not args.no_plots
    assert (args.warmup, args.rep) == (25.0, 100.0)


def test_sweep_is_16k_tokens_and_hidden_2048():
    wls = cli.parse_args(["--sweep"]).workloads
    assert len(wls) == 6 * 2 * 2
    assert {(w.seqlen_q, w.head_dim, w.causal) for w in wls} == {
        (s, d, c) for s in (512, 1024, 2048, 4096, 8192, 16384) for d in (64, 128) for c in (False, True)}
    assert all(w.batch * w.seqlen_q == 16384 and w.heads * w.head_dim == 2048 for w in wls)
    assert all(w.seqlen_k == w.seqlen_q and w.heads_kv == w.heads for w in wls)


def test_explicit_shape_flags_win():
    args = cli.parse_args(["--sweep", "--seqlen", "1024", "2048", "--headdim", "128", "--causal", "yes",
                           "--heads-kv", "4", "--dtype", "bf16", "--mode", "fwdbwd"])
    assert [(w.batch, w.heads, w.heads_kv, w.seqlen_q, w.head_dim, w.causal, w.dtype, w.mode)
            for w in args.workloads] == [(16, 16, 4, 1024, 128, True, "bf16", "fwdbwd"),
                                         (8, 16, 4, 2048, 128, True, "bf16", "fwdbwd")]
    args = cli.parse_args(["--batch", "2", "--heads", "8", "--seqlen", "100", "--causal", "no"])
    assert args.workloads == [W.Workload("fwd", 2, 8, 8, 100, 100, 64, "fp16", False)]


def test_providers_flag(capsys):
    assert cli.parse_args(["--providers", "sdpa-flash, triflash"]).provider_names == ["triflash",
                                                                                     "sdpa-flash"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--providers", "triflash,nope"])
    assert "unknown provider(s) for --mode fwd: nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--mode", "decode", "--providers", "naive"])
    assert "unknown provider(s) for --mode decode: naive" in capsys.readouterr().err


def test_invalid_combinations_are_rejected(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--heads", "16", "--heads-kv", "5"])
    assert "--heads-kv must divide" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--mode", "decode", "--sweep"])
    assert "--sweep is for fwd/bwd/fwdbwd" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--seqlen", "0"])
    assert "argument --seqlen: expected a positive integer, got 0" in capsys.readouterr().err


def test_decode_grid():
    wls = cli.parse_args(["--mode", "decode"]).workloads
    assert [(w.batch, w.seqlen_k) for w in wls] == [(b, c) for b in (1, 16, 64)
                                                    for c in (1024, 8192, 32768, 131072)]
    assert all((w.seqlen_q, w.heads, w.heads_kv, w.head_dim, w.dtype) == (1, 32, 8, 128, "fp16")
               for w in wls)
    assert cli.parse_args(["--mode", "decode"]).provider_names[:2] == ["triflash", "triflash-paged"]


def test_help_and_the_bench_word(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])          # the console script is `triflash bench ...`
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--sweep", "--heads-kv", "--seqlen", "--providers", "--no-plots", "--warmup", "--rep",
                 "--varlen", "TOTAL:MIN-MAX[:SEED]", "--softcap", "--sinks", "--alibi"):
        assert flag in out
    assert "triflash-paged" in out and "flashinfer" in out


# --------------------------------------------------------------------------------------------------
# FLOP and byte conventions
# --------------------------------------------------------------------------------------------------

def test_flop_formula():
    full = 4 * 4 * 16 * 4096 * 4096 * 64
    assert W.attention_flops(4, 16, 4096, 4096, 64, causal=False) == full
    assert W.attention_flops(4, 16, 4096, 4096, 64, causal=True) == full / 2
    assert W.attention_flops(4, 16, 4096, 4096, 64, causal=False, mode="bwd") == 2.5 * full
    assert W.attention_flops(4, 16, 4096, 4096, 64, causal=True, mode="fwdbwd") == 3.5 * full / 2
    assert W.attention_flops(1, 2, 10, 30, 8, causal=False) == 4 * 2 * 10 * 30 * 8
    wl = W.Workload("bwd", 4, 16, 16, 4096, 4096, 64, "fp16", True)
    assert wl.flops == 2.5 * full / 2
    assert Result(wl, "x", "ok", ms=2.0).tflops == pytest.approx(wl.flops / 2e-3 / 1e12)


def test_decode_bytes_convention():
    wl = W.Workload("decode", 16, 32, 8, 1, 8192, 128, "fp16", False)
    assert wl.flops is None
    assert wl.kv_bytes == 2 * 16 * 8192 * 8 * 128 * 2
    r = Result(wl, "x", "ok", ms=0.5)
    assert r.gbps == pytest.approx(wl.kv_bytes / 0.5e-3 / 1e9) and r.tflops is None


# --------------------------------------------------------------------------------------------------
# references used by the checks
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_chunked_reference_gradients_are_exact(causal):
    q, k, v, dout = (torch.randn(1, 37, 2, 16, dtype=torch.float64) for _ in range(4))
    chunked = reference_forward_backward(q, k, v, dout, causal, torch.float64, max_scores=2 * 37 * 5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_ref(*leaves, causal=causal)
    whole = (out, *torch.autograd.grad(out, leaves, dout))
    for got, want in zip(chunked, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_decode_case_pages_are_shuffled_and_hold_the_cache(device):
    wl = W.Workload("decode", 3, 4, 2, 1, 40, 16, "fp16", False)
    case = make_decode_case(wl, device)
    assert case.k_cache.shape == (3, 48, 2, 16)                  # 40 tokens rounded up to 16-token pages
    paged = case.paged()
    assert paged.block_table.dtype == torch.int32 and paged.block_table.shape == (3, 3)
    assert sorted(paged.block_table.flatten().tolist()) == list(range(9))
    assert paged.block_table.flatten().tolist() != list(range(9))
    for b in range(3):
        for i in range(3):
            page = paged.block_table[b, i].item()
            assert torch.equal(paged.k_pages[page], case.k_cache[b, 16 * i:16 * (i + 1)])
            assert torch.equal(paged.v_pages[page], case.v_cache[b, 16 * i:16 * (i + 1)])
    whole = attention_ref(case.q.transpose(1, 2), case.k_cache[:, :40].transpose(1, 2),
                          case.v_cache[:, :40].transpose(1, 2), compute_dtype=torch.float64)
    assert torch.equal(case.expected[0].ref.double(), whole.transpose(1, 2).double())


# --------------------------------------------------------------------------------------------------
# the runner: check before timing, unavailable / wrong / oom / error never stop the run
# --------------------------------------------------------------------------------------------------

class Broken(Provider):
    """Returns the right shape with wrong values."""

    name = "broken"

    def run(self, q, k, v, causal):
        return torch.zeros_like(q)


class Raises(Provider):
    def __init__(self, name, exc):
        self.name, self.exc = name, exc

    def run(self, q, k, v, causal):
        raise self.exc


class ForwardOnly(Naive):
    """Correct values, but no autograd graph (like a provider without a backward)."""

    name = "forward-only"

    def run(self, q, k, v, causal):
        with torch.no_grad():
            return super().run(q, k, v, causal)


def test_unavailable_optional_provider_does_not_stop_the_run(device, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)          # `import flash_attn` now fails
    timer = FakeTimer()
    results = by_provider(run_all([small()], [FlashAttn2(), Naive(), Sdpa("math")], timer, device,
                                  progress=lambda line: None))
    assert results["fa2"].status == "unavailable" and "flash_attn" in results["fa2"].detail
    assert results["fa2"].ms is None
    for name in ("naive", "sdpa-math"):
        assert results[name].status == "ok", results[name].detail
        assert results[name].ms == 1.0 and results[name].max_err <= results[name].tol
    assert timer.calls == 2


def test_wrong_results_are_not_timed_and_failures_are_classified(device):
    timer = FakeTimer()
    providers = [Broken(), Raises("oom", torch.cuda.OutOfMemoryError("CUDA out of memory. Tried ...")),
                 Raises("crash", ValueError("bad stride")), Raises("todo", NotImplementedError("later")),
                 Naive()]
    results = by_provider(run_all([small(causal=True)], providers, timer, device, progress=lambda s: None))
    assert results["broken"].status == "wrong" and "max error" in results["broken"].detail
    assert results["broken"].max_err > results["broken"].tol and results["broken"].ms is None
    assert results["oom"].status == "oom" and "out of memory" in results["oom"].detail
    assert results["crash"].status == "error" and results["crash"].detail == "ValueError: bad stride"
    assert results["todo"].status == "unavailable"
    assert results["naive"].status == "ok"
    assert timer.calls == 1                                         # only naive was timed


def test_backward_is_checked_and_a_provider_without_one_is_unavailable(device):
    timer = FakeTimer()
    results = by_provider(run_all([small("bwd", causal=True)], [ForwardOnly(), Naive(), Sdpa("math")],
                                  timer, device, progress=lambda s: None))
    assert results["forward-only"].status == "unavailable"
    assert "no backward" in results["forward-only"].detail
    assert results["naive"].status == "ok" and results["sdpa-math"].status == "ok"
    assert "max error" in results["naive"].detail


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_triflash_varlen_provider_is_checked_and_timed(device, mode, monkeypatch):
    """The packed path, equal lengths: passes the check (forward, and gradients in bwd), timed
    without the offsets' host check (off by default)."""
    from triflash import api

    seen = []
    provider = TriflashVarlen()
    real_run = TriflashVarlen.run
    monkeypatch.setattr(TriflashVarlen, "run",
                        lambda self, *a: seen.append(api.CHECK_CU_SEQLENS) or real_run(self, *a))
    (result,) = run_all([small(mode, causal=True, batch=2, heads_kv=1)], [provider], FakeTimer(), device,
                        progress=lambda line: None)
    assert result.status == "ok", result.detail
    assert seen and not any(seen)


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_forced_kernel_providers(device, mode, monkeypatch):
    """triflash@triton runs with the choice forced (dispatch.force sees it on every call and it is
    checked like any provider); an unknown variant is reported unavailable, naming it; the CLI
    accepts triflash@ names and still refuses unknown ones."""
    from triflash.bench.providers import forced_provider
    from triflash.kernels import dispatch

    seen = []
    real = dispatch.forward
    monkeypatch.setattr(dispatch, "forward", lambda *a, **kw: seen.append(dispatch._forced_variant("forward"))
                        or real(*a, **kw))
    results = run_all([small(mode, causal=True)], [forced_provider("triflash@triton"),
                                                   forced_provider("triflash@no_such_variant")],
                      FakeTimer(), device, progress=lambda line: None)
    assert results[0].status == "ok", results[0].detail
    assert seen and set(seen) == {"triton"}
    assert dispatch._forced_variant("forward") is None          # the force ends with the provider's run
    assert results[1].status == "unavailable" and "no_such_variant" in results[1].detail
    assert forced_provider("triflash") is None and forced_provider("triflash@") is None
    args = cli.parse_args(["--providers", "triflash,triflash@triton"])
    assert args.provider_names == ["triflash", "triflash@triton"]


class Spy(Naive):
    """Naive attention that records how it is called."""

    name = "spy"

    def __init__(self):
        self.calls, self.inputs = 0, []

    def run(self, q, k, v, causal):
        self.calls += 1
        self.inputs.append((tuple(q.shape), q.is_contiguous(), q.requires_grad))
        return super().run(q, k, v, causal)


@pytest.mark.parametrize("mode, runs_in_timed_fn", [("fwd", 1), ("bwd", 0), ("fwdbwd", 1)])
def test_what_is_timed(device, mode, runs_in_timed_fn):
    """Inputs arrive in the provider's layout, contiguous; bwd's timed function runs no forward."""
    spy, timer = Spy(), FakeTimer()
    (result,) = run_all([small(mode, seqlen_q=48, seqlen_k=48)], [spy], timer, device,
                        progress=lambda line: None)
    assert result.status == "ok", result.detail
    timed_calls = timer.calls + (device == "cuda")          # the memory measurement calls it once more
    forward_outside = 1 if mode == "bwd" else 0             # bwd: one forward before timing
    assert spy.calls == 1 + forward_outside + runs_in_timed_fn * timed_calls
    assert set(spy.inputs) == {((1, 2, 48, 32), True, mode != "fwd")}       # [B, H, S, D]


def test_progress_lines(device):
    lines = []
    run_all([small(seqlen_q=32, seqlen_k=32), small(causal=True)], [Naive(), Sdpa("math")], FakeTimer(),
            device, progress=lines.append)
    # The clock's figures vary: replace them before comparing.
    lines = [re.sub(r"\d+:\d\d elapsed(, ~\d+:\d\d left)?", "T", line) for line in lines]
    assert lines == ["[1/2 T] S=32 D=32 non-causal provider=naive",
                     "[1/2 T] S=32 D=32 non-causal provider=sdpa-math",
                     "[2/2 T] S=64 D=32 causal provider=naive",
                     "[2/2 T] S=64 D=32 causal provider=sdpa-math"]


def test_decode_providers_on_a_small_cache(device):
    """triflash's contiguous and paged decode providers and SDPA, checked against the reference (a
    provider that handed the wrong cache, pages or table to its library would be WRONG here)."""
    wl = W.Workload("decode", 2, 4, 2, 1, 40, 16, "fp16", False)
    results = by_provider(run_all([wl], [TriflashKVCache(paged=False), TriflashKVCache(paged=True),
                                         SdpaDecode("math")], FakeTimer(0.01), device,
                                  progress=lambda s: None))
    for name in ("triflash", "triflash-paged", "sdpa-math"):
        assert results[name].status == "ok", (name, results[name].detail)
        assert results[name].gbps == pytest.approx(wl.kv_bytes / 1e-5 / 1e9)


# --------------------------------------------------------------------------------------------------
# tables and JSON from a fake result set
# --------------------------------------------------------------------------------------------------

def fake_results():
    """Made-up numbers for two sequence lengths, every status, and one decode point."""
    res = []
    for s in (1024, 2048):
        wl = W.Workload("fwd", 16384 // s, 16, 16, s, s, 128, "fp16", True)
        res += [Result(wl, "triflash", "ok", "out max error 1e-03 <= 3e-03", 1e-3, 3e-3, 1.0 * s / 1024,
                       0.9, 1.1, 50.0),
                Result(wl, "naive", "ok", "", 2e-3, 3e-3, 4.0 * s / 1024, 3.9, 4.1, 2000.0),
                Result(wl, "sdpa-flash", "ok", "", 1e-3, 3e-3, 1.25 * s / 1024, 1.2, 1.3, 50.0),
                Result(wl, "sdpa-math", "oom", "CUDA out of memory"),
                Result(wl, "fa3", "wrong", "out max error 0.5 > tolerance 0.003", 0.5, 3e-3),
                Result(wl, "fa2", "unavailable", "No module named 'flash_attn'")]
    dec = W.Workload("decode", 16, 32, 8, 1, 8192, 128, "fp16", False)
    res += [Result(dec, "triflash-paged", "ok", "", 1e-4, 1e-3, 0.05, 0.049, 0.051, 1.0, 0.06, 0.058, 0.062),
            Result(dec, "sdpa-flash", "ok", "", 1e-4, 1e-3, 0.1, 0.09, 0.11, 1.0),
            Result(dec, "sdpa-math", "ok", "", 1e-4, 1e-3, 0.2, 0.19, 0.21, 1.0)]
    add_speedups(res)
    return res


def test_speedups_use_naive_and_the_best_sdpa_backend():
    res = by_provider(r for r in fake_results() if r.workload.seqlen_q == 1024)
    assert res["triflash"].speedup_naive == pytest.approx(4.0)
    assert res["triflash"].speedup_sdpa == pytest.approx(1.25)
    assert res["naive"].speedup_naive == pytest.approx(1.0)
    assert res["fa3"].speedup_naive is None and res["sdpa-math"].speedup_sdpa is None
    dec = by_provider(r for r in fake_results() if r.workload.mode == "decode")
    assert dec["triflash-paged"].speedup_sdpa == pytest.approx(2.0)    # best SDPA: flash, 0.1 ms
    assert dec["triflash-paged"].speedup_naive is None


def test_markdown_tables_from_fake_results():
    text = markdown(fake_results(), "# header")
    assert text.startswith("# header")
    assert "## fwd, fp16, D=128, causal" in text and "## decode, fp16, D=128" in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("| 2048 |") and "| triflash |" in line)
    flops = W.attention_flops(8, 16, 2048, 2048, 128, True)
    assert row.split(" | ")[4:10] == ["2.000", "0.900-1.100", f"{flops / 2e-3 / 1e12:.1f}", "4.00x",
                                      "1.25x", "50.0"]
    assert any("| fa3 |" in line and "WRONG: out max error 0.5 > tolerance 0.003" in line for line in lines)
    assert any("| sdpa-math |" in line and "OOM: CUDA out of memory" in line for line in lines)
    assert not any("| fa2 |" in line for line in lines)          # unavailable: listed below instead
    assert "- fa2: unavailable: No module named 'flash_attn' (2 of 3 workloads)" in text
    dec_row = next(line for line in lines if "| triflash-paged |" in line)
    gbps = 2 * 16 * 8192 * 8 * 128 * 2 / 0.05e-3 / 1e9
    # Graph replays, then eager calls (both in us), then GB/s and the speedup from the graph times.
    assert dec_row.split(" | ")[4:10] == ["50.0", "49.0-51.0", "60.0", "58.0-62.0", f"{gbps:.0f}", "2.00x"]
    assert "graph us/call" in text and "eager us/call" in text


def test_host_mode_workloads_and_table():
    """--mode host: the three short default shapes (fwdbwd workloads, both causal flags by default, or
    the shape given), and a table of host us per kind of call with calls per second."""
    from triflash.bench.cli import parse_args
    from triflash.bench.host import HostResult, host_table

    args = parse_args(["--mode", "host"])
    shapes = {(w.batch, w.seqlen_q, w.heads, w.head_dim) for w in args.workloads}
    assert shapes == set(W.HOST_SHAPES) and {w.mode for w in args.workloads} == {"fwdbwd"}
    assert len(args.workloads) == 2 * len(W.HOST_SHAPES)
    args = parse_args(["--mode", "host", "--seqlen", "256", "--causal", "yes"])
    assert [(w.seqlen_q, w.causal) for w in args.workloads] == [(256, True)]
    wl = args.workloads[0]
    table = host_table([HostResult(wl, "triflash", "ok", us={"fwd no_grad": (40.0, 38.0, 45.0),
                                                             "fwd grad": (60.0, 55.0, 70.0),
                                                             "fwd+bwd": (500.0, 450.0, 600.0)}),
                        HostResult(wl, "fa4", "unavailable", "No module named 'flash_attn'")])
    row = next(line for line in table.splitlines() if "| triflash |" in line)
    assert "40.0 (38.0-45.0)" in row and "500.0 (450.0-600.0)" in row and "25,000" in row
    assert "unavailable: No module named 'flash_attn'" in table


def test_json_has_every_number(tmp_path):
    results = fake_results()
    results[0].max_err = float("nan")
    write_json(tmp_path / "results.json", results, FAKE_ENV, "triflash bench --sweep", 25, 100)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["command"] == "triflash bench --sweep" and data["environment"]["gpu"].startswith("FAKE")
    assert "4·B·H·Sq·Sk·D" in data["conventions"]["flops"]
    assert "do_bench" in data["conventions"]["timing"]
    assert len(data["results"]) == len(results)
    first = data["results"][0]
    assert first["max_err"] is None                            # NaN -> null, the file stays valid JSON
    assert (first["provider"], first["seqlen_q"], first["batch"], first["causal"]) == ("triflash", 1024,
                                                                                        16, True)
    assert first["ms"] == 1.0 and first["ms_p20"] == 0.9 and first["ms_p80"] == 1.1
    assert first["tflops"] == pytest.approx(first["flops"] / 1e-3 / 1e12)
    assert first["speedup_naive"] == pytest.approx(4.0) and first["peak_mib"] == 50.0
    assert data["results"][-1]["gbps"] == pytest.approx(2 * 16 * 8192 * 8 * 128 * 2 / 0.2e-3 / 1e9)
    assert {r["status"] for r in data["results"]} == {"ok", "oom", "wrong", "unavailable"}


# --------------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------------

def test_plots_from_fake_results(tmp_path):
    from triflash.bench.plotting import plot_results

    single = W.Workload("bwd", 4, 16, 16, 4096, 4096, 64, "bf16", False)
    extra = [Result(single, "triflash", "ok", "", 1e-3, 3e-3, 2.0, 1.9, 2.1, 10.0),
             Result(single, "naive", "ok", "", 1e-3, 3e-3, 5.0, 4.9, 5.1, 900.0)]
    add_speedups(extra)
    paths = plot_results(fake_results() + extra, FAKE_ENV, tmp_path)
    assert sorted(p.name for p in paths) == ["bwd-bf16-d64-noncausal.png", "decode-fp16-d128.png",
                                             "fwd-fp16-d128-causal.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 20_000


def test_plot_axes_read_right():
    """Bar charts of one shape: the latency axis is logarithmic when naive is 2.5x+ slower (a linear
    one flattened the fast providers' bars), with p20-p80 error bars; a memory axis of nearly equal
    values starts at 0 (it read 64-66 MiB as a huge gap); panels with nothing to show are left out
    (there was an empty "not measured" panel)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from triflash.bench.plotting import _draw_dense

    wl = W.Workload("fwd", 4, 16, 16, 4096, 4096, 64, "fp16", False)
    res = [Result(wl, "triflash", "ok", "", 1e-3, 3e-3, 1.0, 0.9, 1.1, 64.0),
           Result(wl, "naive", "ok", "", 1e-3, 3e-3, 40.0, 39.0, 41.0, 66.0)]
    add_speedups(res)
    fig = Figure()
    _draw_dense(fig, res)
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert set(axes) == {"Latency (bars: p20-p80)", "Throughput", "Speedup over naive PyTorch",
                         "Peak extra memory"}
    latency = axes["Latency (bars: p20-p80)"]
    assert latency.get_yscale() == "log"
    assert any(len(c.get_segments()) == 2 for c in latency.collections)       # the two error bars
    memory = axes["Peak extra memory"]
    assert memory.get_yscale() == "linear" and memory.get_ylim()[0] == 0
    for r in res:
        r.peak_mib = None                                # not measured (the CPU): no memory panel
    fig = Figure()
    _draw_dense(fig, res)
    assert "Peak extra memory" not in {ax.get_title() for ax in fig.axes} and len(fig.axes) == 3


def test_plots_skipped_without_matplotlib(tmp_path, monkeypatch):
    from triflash.bench.plotting import plot_results

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert plot_results(fake_results(), FAKE_ENV, tmp_path) is None
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------------
# the command, end to end (fake timer on the current device; the real one needs a GPU)
# --------------------------------------------------------------------------------------------------

def test_run_benchmark_writes_table_json_and_plots(tmp_path, device, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    argv = ["--batch", "1", "--heads", "2", "--seqlen", "64", "128", "--headdim", "32", "--causal", "yes",
            "--providers", "triflash,naive,sdpa-math,fa2", "--out", str(tmp_path)]
    rc = cli.run_benchmark(cli.parse_args(argv), argv, device, FakeTimer(), FAKE_ENV)
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.count("| triflash |") == 2 and out.count("| naive |") == 2
    assert "- fa2: unavailable" in out and "left] S=128 D=32 causal provider=sdpa-math" in err
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["results"]) == 2 * 4
    assert (tmp_path / "results.md").read_text() + "\n" == out           # print() adds one newline
    triflash_rows = [r for r in data["results"] if r["provider"] == "triflash"]
    assert all(r["status"] == "ok" and r["max_err"] <= r["tol"] for r in triflash_rows)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "Plots: skipped, matplotlib is not installed" in err
    else:
        assert (tmp_path / "fwd-fp16-d32-causal.png").exists()


def test_exit_status_is_1_when_triflash_is_wrong(tmp_path, device, monkeypatch, capsys):
    monkeypatch.setattr(triflash, "flash_attn_func", lambda q, k, v, causal: q * 0)
    argv = ["--batch", "1", "--heads", "2", "--seqlen", "64", "--headdim", "32", "--causal", "no",
            "--providers", "triflash", "--out", str(tmp_path), "--no-plots"]
    assert cli.run_benchmark(cli.parse_args(argv), argv, device, FakeTimer(), FAKE_ENV) == 1
    assert "WRONG" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# without a GPU
# --------------------------------------------------------------------------------------------------

def test_no_gpu_command_checks_the_kernel_in_the_interpreter(tmp_path):
    """`python -m triflash.bench` with CUDA hidden and TRITON_INTERPRET unset: it must say there is no
    GPU, switch to the interpreter itself (a fresh process), find the kernel correct, time nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-m", "triflash.bench"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert "No CUDA GPU found" in run.stdout
    blocker = interpreter_blocker()
    if blocker:
        # An environment whose interpreter cannot work (Triton 3.6 with numpy >= 2.4, as on our GPU
        # image): the command must say why and how to fix it, and fail.
        assert run.returncode != 0 and blocker in run.stdout, run.stdout + run.stderr
        return
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Triton's interpreter" in run.stdout
    checks = [line for line in run.stdout.splitlines() if "max error" in line]
    assert len(checks) == 2 and all(line.endswith(": correct") for line in checks)
    assert "causal" in checks[1] and "non-causal" in checks[0]
    assert "TFLOP" not in run.stdout and " ms" not in run.stdout and "GB/s" not in run.stdout
    assert list(tmp_path.iterdir()) == []                         # nothing written without a GPU


def test_interpreter_blocker_versions():
    assert "numpy < 2.4" in interpreter_blocker("3.6.0", "2.5.2")
    assert interpreter_blocker("3.6.0", "2.3.5") is None
    assert interpreter_blocker("3.9.0", "2.5.2") is None


def test_no_gpu_check_reports_wrong_kernels():
    from io import StringIO

    out = StringIO()
    assert not report_without_gpu((False, True), fn=lambda q, k, v, causal: q, out=out)
    text = out.getvalue()
    assert text.count("WRONG") == 2 and "Some checks FAILED." in text

    def crash(q, k, v, causal):
        raise RuntimeError("kernel exploded")

    out = StringIO()
    assert not report_without_gpu((True,), fn=crash, out=out)
    assert "WRONG (RuntimeError: kernel exploded)" in out.getvalue()


def test_dense_case_references_agree_with_naive(device):
    case = make_dense_case(small(causal=True), device)
    got = naive_attention(*(t.transpose(1, 2) for t in (case.q, case.k, case.v)),
                          causal=True).transpose(1, 2)
    exp = case.expected[0]
    assert exp.name == "out" and 0 < exp.tol < 0.05
    assert (got.to(exp.ref.dtype) - exp.ref).abs().max().item() <= exp.tol


def test_version_fp32_and_progress_clock(capsys):
    """``triflash bench --version`` prints the versions; fp32 is a --dtype; progress lines carry the
    elapsed time and, once a workload is done, an estimate of the time left."""
    from triflash.bench.cli import parse_args
    from triflash.bench.runner import Progress

    with pytest.raises(SystemExit) as stop:
        parse_args(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("triflash ") and "torch" in out and "triton" in out
    assert {w.dtype for w in parse_args(["--dtype", "fp32"]).workloads} == {"fp32"}
    clock = Progress(4)
    clock.start -= 90                          # 1:30 spent on the first two workloads
    assert clock.status(0) == "1:30 elapsed"
    assert clock.status(2) == "1:30 elapsed, ~1:30 left"


# --------------------------------------------------------------------------------------------------
# --window
# --------------------------------------------------------------------------------------------------

def test_window_workloads_count_the_visible_scores(capsys):
    """--window LEFT,RIGHT: the workloads carry it, TFLOP/s count exactly the visible score entries
    (brute force over the mask), a causal workload refuses a right bound > 0, host refuses it."""
    from triflash.reference import causal_visible

    args = cli.parse_args(["--window", "3,0", "--seqlen", "40", "--causal", "yes", "--mode", "bwd"])
    (wl,) = args.workloads
    assert wl.window == (3, 0) and "window=3,0" in wl.label()
    for sq, sk, window, causal in ((40, 40, (3, 0), True), (7, 19, (2, 5), False), (19, 7, (-1, 1), False),
                                   (10, 10, (100, -1), True), (5, 9, (0, 0), False)):
        brute = int(causal_visible(sq, sk, window_size=window, causal=causal).sum())
        assert W.visible_entries(sq, sk, window, causal) == brute, (sq, sk, window, causal)
    assert wl.flops == pytest.approx(4 * 4 * 16 * W.visible_entries(40, 40, (3, 0), True) * 64 * 2.5)
    with pytest.raises(SystemExit):
        cli.parse_args(["--window", "3,2", "--causal", "yes"])
    assert "--window 3,2 with a causal workload" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--window", "3", "--causal", "no"])
    assert "argument --window: expected LEFT,RIGHT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--window", "3,0", "--mode", "host"])
    assert "--window is for fwd/bwd/fwdbwd/decode; got --mode host" in capsys.readouterr().err


def test_decode_window_workloads_count_the_keys_read():
    """--mode decode --window LEFT,RIGHT: each point carries the window, and its GB/s counts the
    left + 1 keys the query token sees (the whole context when the window holds more)."""
    args = cli.parse_args(["--window", "100,0", "--mode", "decode", "--batch", "2", "--seqlen", "1024", "64",
                           "--heads", "4", "--heads-kv", "2", "--headdim", "64"])
    short, long_ = sorted(args.workloads, key=lambda w: w.seqlen_k)
    assert long_.window == (100, 0) and "window=100,0" in long_.label()
    assert long_.kv_bytes == 2 * 2 * 101 * 2 * 64 * 2
    assert short.kv_bytes == 2 * 2 * 64 * 2 * 64 * 2


def test_decode_window_providers_checked_and_refused(device):
    """With a window, triflash's contiguous and paged decode providers are checked against the windowed
    reference (and pass); SDPA, which takes no window, is reported unavailable."""
    wl = W.Workload("decode", 2, 4, 2, 1, 40, 16, "fp16", False, window=(5, 0))
    results = by_provider(run_all([wl], [TriflashKVCache(paged=False), TriflashKVCache(paged=True),
                                         SdpaDecode("math")], FakeTimer(0.01), device, progress=lambda s: None))
    for name in ("triflash", "triflash-paged"):
        assert results[name].status == "ok", (name, results[name].detail)
    assert results["sdpa-math"].status == "unavailable" and "window" in results["sdpa-math"].detail
    plain = make_decode_case(W.Workload("decode", 2, 4, 2, 1, 40, 16, "fp16", False), device)
    assert not torch.allclose(make_decode_case(wl, device).expected[0].ref, plain.expected[0].ref)


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_window_providers_checked_and_refused(device, mode):
    """With a window: triflash is checked against the windowed reference (and passes); a provider
    without windows (naive) is reported unavailable, not run on the wrong problem."""
    wl = W.Workload(mode, 1, 2, 1, 48, 48, 32, "fp16", True, window=(5, 0))
    results = {r.provider: r for r in run_all([wl], [Triflash(), Naive()], FakeTimer(), device,
                                              progress=lambda line: None)}
    assert results["triflash"].status == "ok", results["triflash"].detail
    assert results["naive"].status == "unavailable" and "window" in results["naive"].detail
    # The reference really is windowed: a full causal reference differs from it.
    case = make_dense_case(wl, device)
    full = make_dense_case(W.Workload(mode, 1, 2, 1, 48, 48, 32, "fp16", True), device)
    assert not torch.allclose(case.expected[0].ref, full.expected[0].ref)


# --------------------------------------------------------------------------------------------------
# --varlen: packed sequences of different lengths
# --------------------------------------------------------------------------------------------------

def test_varlen_syntax_and_errors(capsys):
    """TOTAL:MIN-MAX[:SEED] draws lengths (k = x1024), L1,L2,... gives them, several specs give several
    workloads; bad syntax is refused naming the spec, and so are the flags --varlen replaces."""
    args = cli.parse_args(["--varlen", "4k:100-1k:7", "5,300,17", "--headdim", "64", "128", "--causal", "yes",
                           "--heads", "8", "--heads-kv", "2", "--mode", "fwdbwd"])
    assert [(w.head_dim, w.seqlens) for w in args.workloads] == [
        (d, lengths) for d in (64, 128) for lengths in (W.varlen_lengths(4096, 100, 1024, 7), (5, 300, 17))]
    wl = args.workloads[1]
    assert (wl.batch, wl.seqlen_q, wl.seqlen_k, wl.tokens, wl.heads, wl.heads_kv, wl.mode, wl.causal) == (
        3, 300, 300, 322, 8, 2, "fwdbwd", True)
    assert wl.label() == "varlen 3 seqs 5-300, 322 tokens D=64 causal"
    for bad in ("32k:512", "32k:512-4k:1:2", "a,b", "0,5", "10:1-2:-1", "16k:0-8", "1.5k:1-2"):
        with pytest.raises(SystemExit):
            cli.parse_args(["--varlen", bad])
        err = capsys.readouterr().err
        assert "argument --varlen: expected TOTAL:MIN-MAX[:SEED] or L1,L2,..." in err and repr(bad) in err, err
    with pytest.raises(SystemExit):
        cli.parse_args(["--varlen", "1k:4k-512"])
    assert "MIN (4096) is larger than MAX (512) in '1k:4k-512'" in capsys.readouterr().err
    for extra in (["--seqlen", "128"], ["--batch", "2"], ["--sweep"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["--varlen", "1k:8-64", *extra])
        assert f"--varlen sets the sequence lengths and their number: drop {extra[0]}" in capsys.readouterr().err
    for mode in ("decode", "host"):
        with pytest.raises(SystemExit):
            cli.parse_args(["--varlen", "1k:8-64", "--mode", mode])
        assert f"--varlen is for fwd/bwd/fwdbwd; got --mode {mode}" in capsys.readouterr().err


def test_varlen_lengths_are_seeded_and_sum_to_total():
    for total, low, high, seed in ((32768, 512, 4096, 0), (16384, 128, 2048, 3), (1000, 1, 7, 1), (50, 64, 64, 0)):
        lengths = W.varlen_lengths(total, low, high, seed)
        assert sum(lengths) == total
        assert lengths == W.varlen_lengths(total, low, high, seed)               # reproducible
        assert all(low <= n <= high for n in lengths[:-1]) and 1 <= lengths[-1] <= high
    assert W.varlen_lengths(32768, 512, 4096, 0) != W.varlen_lengths(32768, 512, 4096, 1)
    lengths = W.varlen_lengths(100_000, 1, 100, 5)
    assert min(lengths[:-1]) <= 5 and max(lengths) >= 95      # drawn over the whole range, not one value
    assert cli._varlen("32k:512-4k") == W.varlen_lengths(32768, 512, 4096, 0)
    with pytest.raises(ValueError, match="1 <= MIN <= MAX, got 10:5-4"):
        W.varlen_lengths(10, 5, 4)


def test_varlen_flops_count_the_visible_scores():
    """4·H·D FLOPs per visible score entry, summed over the sequences (brute force over each
    sequence's own mask), times the mode's factor; the table shows the lengths and the total."""
    from triflash.reference import causal_visible

    lengths = (5, 1, 33, 17)
    for causal, window in ((False, None), (True, None), (True, (3, 0)), (False, (2, 4))):
        brute = sum(int(causal_visible(n, n, window_size=window or (-1, -1), causal=causal).sum()) for n in lengths)
        for mode, factor in (("fwd", 1.0), ("bwd", 2.5), ("fwdbwd", 3.5)):
            wl = W.Workload(mode, 4, 3, 1, 33, 33, 16, "fp16", causal, window, seqlens=lengths)
            assert wl.flops == 4 * 3 * 16 * brute * factor, (causal, window, mode)
    causal = W.Workload("fwd", 4, 3, 3, 33, 33, 16, "fp16", True, seqlens=lengths)
    assert causal.flops == 4 * 3 * 16 * sum(n * (n + 1) // 2 for n in lengths)
    r = Result(causal, "triflash", "ok", ms=1.0, ms_p20=0.9, ms_p80=1.1)
    text = markdown([r], "# h")
    assert "## fwd, fp16, D=16, causal, varlen 4 seqs 1-33, 56 tokens" in text
    assert "| 1-33 (56 tok) | 4 | 3 | triflash |" in text


class IgnoresOffsets(Triflash):
    """Packed sequences run as one long sequence: what a provider that drops cu_seqlens computes."""

    name = "ignores-offsets"

    def run(self, q, k, v, causal):
        cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        return self.varlen_fn(q, k, v, cu, cu, q.shape[0], q.shape[0], causal=causal)


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_varlen_end_to_end(tmp_path, device, mode, capsys):
    """--varlen through the command: triflash (flash_attn_varlen_func) passes the per-sequence check
    and is timed; SDPA runs non-causal packed sequences as nested jagged tensors (math backend on the
    CPU) and declines causal ones with the reason; naive is unavailable; a provider that ignores the
    offsets is WRONG (the check is per sequence)."""
    argv = ["--varlen", "40,9,23", "--heads", "2", "--headdim", "32", "--mode", mode, "--out", str(tmp_path),
            "--providers", "triflash,naive,sdpa-math", "--no-plots"]
    args = cli.parse_args(argv)
    assert [w.causal for w in args.workloads] == [False, True]
    assert cli.run_benchmark(args, argv, device, FakeTimer(), FAKE_ENV) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "results.json").read_text())["results"]
    got = {(r["provider"], r["causal"]): r for r in data}
    for causal in (False, True):
        tri = got[("triflash", causal)]
        assert tri["status"] == "ok" and tri["max_err"] <= tri["tol"], tri["detail"]
        assert tri["seqlens"] == [40, 9, 23] and tri["flops"] == args.workloads[causal].flops
        assert got[("naive", causal)]["status"] == "unavailable"
    assert got[("sdpa-math", False)]["status"] == "ok", got[("sdpa-math", False)]["detail"]
    assert got[("sdpa-math", True)]["status"] == "unavailable"
    assert "- naive: unavailable: naive takes no packed sequences of different lengths (varlen)" in out
    assert "- sdpa-math: unavailable: SDPA's math backend takes no is_causal with nested (jagged) tensors" in out
    assert "| 9-40 (72 tok) | 3 | 2 | triflash |" in out
    (wrong,) = run_all([args.workloads[0]], [IgnoresOffsets()], FakeTimer(), device, progress=lambda s: None)
    assert wrong.status == "wrong"


# --------------------------------------------------------------------------------------------------
# --softcap, --sinks, --alibi
# --------------------------------------------------------------------------------------------------

def test_score_variant_flags(capsys):
    args = cli.parse_args(["--softcap", "30", "--sinks", "--alibi", "--seqlen", "64", "--causal", "yes"])
    (wl,) = args.workloads
    assert (wl.softcap, wl.sinks, wl.alibi, wl.variants) == (30.0, True, True, ("softcap", "sinks", "alibi"))
    assert wl.label() == "S=64 D=64 causal softcap=30 sinks alibi"
    assert cli.parse_args([]).workloads[0].variants == ()
    dec = cli.parse_args(["--mode", "decode", "--sinks", "--seqlen", "64", "--batch", "1"]).workloads
    assert [(w.mode, w.sinks) for w in dec] == [("decode", True)]
    varlen = cli.parse_args(["--varlen", "8,16", "--alibi"]).workloads
    assert all(w.alibi and w.seqlens == (8, 16) for w in varlen)
    for bad in ("0", "-1", "abc", "inf", "nan", "1e39"):       # 1e39: no float32 number, as the kernels hold it
        with pytest.raises(SystemExit):
            cli.parse_args(["--softcap", bad])
        assert f"argument --softcap: expected a finite number > 0, got {bad!r}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--mode", "host", "--sinks"])
    assert "--softcap, --sinks and --alibi are for fwd/bwd/fwdbwd/decode; got --mode host" in capsys.readouterr().err


def test_alibi_slopes_and_sinks_are_the_standard_ones(device):
    assert W.alibi_slopes(8) == [2.0 ** -(h + 1) for h in range(8)]
    assert W.alibi_slopes(4) == [2.0 ** (-2 * (h + 1)) for h in range(4)]
    twelve = W.alibi_slopes(12)                 # not a power of two: 8 slopes, then every other of 16
    assert twelve[:8] == W.alibi_slopes(8) and twelve[8:] == W.alibi_slopes(16)[0::2][:4]
    from triflash.bench.checking import make_variants

    variants = make_variants(W.Workload("fwd", 1, 6, 2, 8, 8, 16, "fp16", True, softcap=4.0, sinks=True,
                                        alibi=True), device)
    assert variants.softcap == 4.0 and variants.sinks.dtype == torch.float32 and variants.sinks.shape == (6,)
    assert torch.equal(variants.sinks.to(torch.bfloat16).float(), variants.sinks)    # exact in bfloat16
    assert variants.sinks.std() > 0.3
    again = make_variants(W.Workload("bwd", 2, 6, 6, 4, 4, 8, "bf16", False, sinks=True), device)
    assert torch.equal(again.sinks, variants.sinks) and again.alibi_slopes is None       # seeded
    assert variants.alibi_slopes.tolist() == W.alibi_slopes(6)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 3)), (False, (-1, 4))],
                         ids=["full", "causal", "window-6-3", "right-4"])
def test_chunked_reference_with_score_variants_is_exact(monkeypatch, causal, window):
    """The chunked autograd reference with softcap, sinks and ALiBi, causal or not, with windows whose
    rows see later keys too, in chunks of 5 rows (so no chunk holds the whole problem), equals one
    whole autograd pass."""
    from triflash.bench import checking

    q, k, v, dout = (torch.randn(2, 37, 2, 16, dtype=torch.float64) for _ in range(4))
    kw = dict(softcap=2.0, sinks=torch.tensor([0.5, -1.0], dtype=torch.float64),
              alibi_slopes=torch.tensor([0.25, 0.0625], dtype=torch.float64))
    chunks = []
    real = checking.flash_attn_ref

    def spy(q, *args, **kwargs):
        chunks.append(q.shape[:2])
        return real(q, *args, **kwargs)
    monkeypatch.setattr(checking, "flash_attn_ref", spy)
    chunked = reference_forward_backward(q, k, v, dout, causal, torch.float64, max_scores=2 * 2 * 37 * 5,
                                         window=window, **kw)
    assert chunks == [(2, 5)] * 7 + [(2, 2)]             # the whole batch, 5 rows at a time
    monkeypatch.undo()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_ref(*leaves, causal=causal, window_size=window, **kw)
    whole = (out, *torch.autograd.grad(out, leaves, dout))
    for got, want in zip(chunked, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    plain = reference_forward_backward(q, k, v, dout, causal, torch.float64, window=window)
    assert not torch.allclose(plain[0], chunked[0])


class DropsVariants(Triflash):
    """Takes the variants' flags but computes plain attention: the check must catch it."""

    name = "drops-variants"

    def run(self, q, k, v, causal):
        self.call_kwargs = {}
        return super().run(q, k, v, causal)


def test_score_variants_end_to_end(tmp_path, device, capsys):
    """--softcap/--sinks/--alibi through the command: triflash is checked against the reference with
    the variants (forward and gradients) and passes; SDPA and naive are unavailable, saying why; a
    provider that drops the variants is WRONG."""
    argv = ["--softcap", "5", "--sinks", "--alibi", "--batch", "1", "--seqlen", "48", "--heads", "4",
            "--heads-kv", "2", "--headdim", "32", "--causal", "yes", "--mode", "fwdbwd", "--out", str(tmp_path),
            "--providers", "triflash,naive,sdpa-math"]
    args = cli.parse_args(argv)
    assert cli.run_benchmark(args, argv, device, FakeTimer(), FAKE_ENV) == 0
    out = capsys.readouterr().out
    results = {r["provider"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert results["triflash"]["status"] == "ok", results["triflash"]["detail"]
    assert (results["triflash"]["softcap"], results["triflash"]["sinks"], results["triflash"]["alibi"]) == (
        5.0, True, True)
    assert "## fwdbwd, fp16, D=32, causal, softcap=5 sinks alibi" in out
    assert ("- sdpa-math: unavailable: sdpa-math takes no soft-capping (softcap), attention sinks or ALiBi "
            "slopes") in out
    assert results["naive"]["status"] == "unavailable"
    (wrong,) = run_all(args.workloads, [DropsVariants()], FakeTimer(), device, progress=lambda s: None)
    assert wrong.status == "wrong"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "fwdbwd-fp16-d32-causal-softcap5-sinks-alibi.png").exists()      # its own figure


def test_varlen_with_variants_and_decode_with_variants(device):
    """Packed sequences with the variants (ALiBi per sequence) through triflash-varlen, and decode
    with them through triflash's contiguous cache; SDPA's decode is unavailable."""
    from triflash.bench.providers import TriflashVarlen

    wl = W.Workload("fwd", 3, 2, 1, 30, 30, 16, "fp16", True, seqlens=(30, 7, 12), softcap=3.0, sinks=True,
                    alibi=True)
    (res,) = run_all([wl], [TriflashVarlen()], FakeTimer(), device, progress=lambda s: None)
    assert res.status == "ok", res.detail
    dec = W.Workload("decode", 2, 4, 2, 1, 40, 16, "fp16", False, softcap=3.0, sinks=True, alibi=True)
    results = by_provider(run_all([dec], [TriflashKVCache(paged=False), SdpaDecode("math")], FakeTimer(0.01),
                                  device, progress=lambda s: None))
    assert results["triflash"].status == "ok", results["triflash"].detail
    assert results["sdpa-math"].status == "unavailable" and "attention sinks" in results["sdpa-math"].detail
    plain = make_decode_case(W.Workload("decode", 2, 4, 2, 1, 40, 16, "fp16", False), device)
    assert not torch.allclose(make_decode_case(dec, device).expected[0].ref, plain.expected[0].ref)


# --------------------------------------------------------------------------------------------------
# FlashAttention 4 as a provider of varlen and the variants (a stand-in module: no GPU here)
# --------------------------------------------------------------------------------------------------

def _fake_fa4(monkeypatch, *, sinks_keyword=True, varlen=True, backward_source=None):
    """A stand-in ``flash_attn.cute`` with FA4's signatures that computes with triflash and insists on
    FA4's argument conventions (bfloat16 learnable_sink, None for an unbounded window side)."""
    import types

    def check(learnable_sink, window_size):
        assert learnable_sink is None or learnable_sink.dtype == torch.bfloat16, "learnable_sink must be bfloat16"
        assert all(w is None or w >= 0 for w in window_size)
        return dict(sinks=None if learnable_sink is None else learnable_sink.float(),
                    window_size=tuple(-1 if w is None else w for w in window_size))

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                        learnable_sink=None, softcap=0.0, num_splits=1, return_lse=False):
        return triflash.flash_attn_func(q, k, v, causal=causal, softcap=softcap, **check(learnable_sink, window_size))

    def flash_attn_func_no_sinks(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0):
        return triflash.flash_attn_func(q, k, v, causal=causal, softcap=softcap, **check(None, window_size))

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, seqused_q=None, seqused_k=None, page_table=None,
                               softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
                               softcap=0.0, num_splits=1, return_lse=False):
        return triflash.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               causal=causal, softcap=softcap, **check(learnable_sink, window_size))

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func if sinks_keyword else flash_attn_func_no_sinks
    cute.flash_attn_func.__module__ = "flash_attn.cute"
    if varlen:
        cute.flash_attn_varlen_func = flash_attn_varlen_func
    if backward_source is not None:
        cute.FlashAttnFunc = backward_source
    package = types.ModuleType("flash_attn")
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)


class _Fa4BackwardWithoutSoftcap:
    """What FA4's autograd Function looked like in versions without a softcap backward."""

    @staticmethod
    def backward(ctx, dout, *args):
        assert ctx.softcap == 0.0


def test_fa4_provider_varlen_and_variants(device, monkeypatch):
    """fa4 passes packed sequences to flash_attn.cute.flash_attn_varlen_func by keyword, sinks as a
    bfloat16 learnable_sink (the same values: ok against the float32 reference) and softcap; it is
    unavailable for ALiBi, for a version whose signature lacks an argument, without a varlen entry
    point, and for a softcap backward where FA4's backward asserts softcap == 0."""
    from triflash.bench.providers import FlashAttn4

    _fake_fa4(monkeypatch, backward_source=_Fa4BackwardWithoutSoftcap)
    packed = W.Workload("fwd", 2, 2, 2, 24, 24, 16, "fp16", True, seqlens=(24, 11), sinks=True, softcap=4.0)
    dense = W.Workload("fwd", 1, 2, 2, 24, 24, 16, "fp16", True, window=(5, 0), sinks=True)
    alibi = W.Workload("fwd", 1, 2, 2, 24, 24, 16, "fp16", False, alibi=True)
    softcap_bwd = W.Workload("bwd", 1, 2, 2, 24, 24, 16, "fp16", False, softcap=4.0)
    res = run_all([packed, dense, alibi, softcap_bwd], [FlashAttn4()], FakeTimer(), device, progress=lambda s: None)
    assert [r.status for r in res[:2]] == ["ok", "ok"], [r.detail for r in res]
    assert res[2].status == "unavailable" and res[2].detail == "fa4 takes no ALiBi slopes"
    assert res[3].status == "unavailable" and "FA4's backward takes no softcap" in res[3].detail
    _fake_fa4(monkeypatch, sinks_keyword=False, varlen=False)
    res = run_all([dense, packed], [FlashAttn4()], FakeTimer(), device, progress=lambda s: None)
    assert res[0].status == "unavailable" and "takes no learnable_sink=" in res[0].detail
    assert res[1].status == "unavailable" and "no flash_attn_varlen_func" in res[1].detail

"""Without a GPU: check triflash's forward kernel in Triton's interpreter on a small problem.

Nothing is timed (CPU interpreter times say nothing about a GPU). The kernel's output is compared
with the float64 reference under the benchmark's tolerance rule (``checking``), and the result is
printed as "correct" or "WRONG".

Triton decides between compiling and interpreting a kernel when the kernel is defined, i.e. when
``triflash.kernels`` is imported, from the TRITON_INTERPRET environment variable. Importing
``triflash.bench`` imports the ``triflash`` package, which already defines the kernels; so when that
happened without TRITON_INTERPRET=1, the command runs itself again in a fresh process with it set.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace

from .checking import CheckResult, check, make_dense_case
from .workloads import Workload

SMALL = Workload("fwd", batch=1, heads=2, heads_kv=2, seqlen_q=128, seqlen_k=128, head_dim=64,
                 dtype="fp16", causal=False)
# Set in the child process, so that a child that still cannot interpret says so instead of looping.
REEXEC_MARK = "TRIFLASH_BENCH_INTERPRETER_CHILD"


def interpreter_ready() -> bool:
    """True when triflash's kernels run (or will run) in Triton's interpreter in this process."""
    configs = sys.modules.get("triflash.kernels.configs")
    if configs is None:
        # Kernels not defined yet: switching the interpreter on now is still in time.
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    return configs.INTERPRET


def rerun_with_interpreter(argv: list[str]) -> int:
    """Run ``python -m triflash.bench ARGV`` again with TRITON_INTERPRET=1; return its exit code."""
    if os.environ.get(REEXEC_MARK):
        print("error: TRITON_INTERPRET=1 is set but triflash's kernels are still compiled for a GPU",
              file=sys.stderr)
        return 2
    env = {**os.environ, "TRITON_INTERPRET": "1", REEXEC_MARK: "1"}
    return subprocess.run([sys.executable, "-m", "triflash.bench", *argv], env=env).returncode


def interpreter_blocker(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why Triton's interpreter cannot run here, or None. Triton 3.6's interpreter breaks on
    numpy 2.4+ ("only 0-dimensional arrays can be converted to Python scalars"); 3.7+ is fine."""
    if triton_version is None:
        import triton

        triton_version = triton.__version__
    if numpy_version is None:
        import numpy

        numpy_version = numpy.__version__

    def major_minor(v):
        return tuple(int(x) for x in v.split(".")[:2])

    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter needs numpy < 2.4, but numpy {numpy_version} is "
                f"installed: pip install 'numpy<2.4' (or triflash[bench], which pins it)")
    return None


def check_small(causal: bool, fn=None) -> CheckResult:
    """triflash.flash_attn_func (or ``fn``, same signature) on SMALL, against the reference."""
    if fn is None:
        import triflash

        fn = triflash.flash_attn_func
    case = make_dense_case(replace(SMALL, causal=causal), "cpu")
    try:
        out = fn(case.q, case.k, case.v, causal=causal)
    except Exception as exc:  # noqa: BLE001 - a crash is reported as a failed check
        return CheckResult(False, math.nan, case.expected[0].tol, f"{type(exc).__name__}: {exc}")
    return check([out], case.expected)


def report_without_gpu(causal_flags, fn=None, out=sys.stdout) -> bool:
    """Print the no-GPU notice and the interpreter check; True when every check passed."""
    wl = SMALL
    print("No CUDA GPU found (torch.cuda.is_available() is False), so nothing is timed.", file=out)
    print("Checking triflash's forward kernel in Triton's interpreter (TRITON_INTERPRET=1, on the CPU) "
          "against the float64 reference instead, at one small fp16 shape (the workload options "
          "--mode, --dtype, --headdim, ... apply to GPU runs only):", file=out)
    blocker = interpreter_blocker() if fn is None else None
    if blocker:
        print(f"  cannot run the check: {blocker}", file=out)
        return False
    all_ok = True
    for causal in causal_flags:
        result = check_small(causal, fn)
        all_ok &= result.ok
        shape = (f"B={wl.batch} H={wl.heads} S={wl.seqlen_q} D={wl.head_dim} {wl.dtype} "
                 f"{'causal' if causal else 'non-causal'}")
        verdict = "correct" if result.ok else f"WRONG ({result.detail})"
        print(f"  {shape:<34} max error {result.max_err:.2e} (tolerance {result.tol:.2e}): {verdict}",
              file=out)
    print("All correct." if all_ok else "Some checks FAILED.", file=out)
    print("Run on a machine with a CUDA GPU for timings.", file=out)
    return all_ok

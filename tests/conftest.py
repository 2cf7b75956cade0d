"""Shared test setup: one suite for the CPU (Triton's interpreter) and a CUDA GPU.

Without a CUDA device the suite runs every kernel through Triton's interpreter, which must be switched
on before triton is imported: that is done here, first thing.
"""

import faulthandler
import os
import zlib

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Imported here, not in the fixtures that use them: their first import (triton, torch's compile
# machinery) takes seconds on a loaded machine, which must not count against a test's hang guard.
from triflash.kernels import launch  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"

# bf16 runs in the interpreter too: triflash.kernels.interpreter widens bf16 dot operands there.
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def pytest_report_header(config):
    import triton

    where = torch.cuda.get_device_name() if ON_GPU else "CPU, TRITON_INTERPRET=1"
    return f"triflash tests on {where}; torch {torch.__version__}, triton {triton.__version__}"


@pytest.fixture
def device():
    return DEVICE


# A test that runs longer than this many seconds is stopped: its process prints every thread's
# stack and exits. So a kernel that never finishes (say, a barrier waited for that is never arrived
# at) fails the test it is in, and the stack names the call, where it would otherwise hold the whole
# run until an outer time limit (a GPU session's device call) and report nothing. Under xdist the
# worker is replaced and the run goes on. 0 turns the guard off.
TEST_TIMEOUT = float(os.environ.get("TRIFLASH_TEST_TIMEOUT", "900"))
_GUARD_FD = []      # a copy of the process's own stderr, taken while pytest's capture is suspended


def pytest_configure(config):
    # The stacks must reach the terminal: while a test runs, pytest's capture has fd 2 pointing
    # into a temporary file that nobody reads once the process has exited. Only where tests run: an
    # xdist controller runs none, and suspending its capture here broke its report of -x stops.
    # (A worker has ``workerinput``; the environment variable would be inherited by a nested run.)
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture()
    try:
        _GUARD_FD.append(os.dup(2))
    finally:
        if capman is not None:
            capman.resume_global_capture()


@pytest.fixture(autouse=True)
def _hang_guard():
    if TEST_TIMEOUT > 0:
        faulthandler.dump_traceback_later(TEST_TIMEOUT, exit=True,
                                          file=_GUARD_FD[0] if _GUARD_FD else 2)
    yield
    if TEST_TIMEOUT > 0:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _plans(request):
    """Call plans (triflash.kernels.launch) are recorded on a key's first call here, so every test's
    first call of a shape runs under the recorder and any repeat replays. A test that replaces
    launchers or choosers (monkeypatch) runs without plans: a plan recorded before the patch would
    replay the unpatched launches."""
    saved = launch.ENABLED, launch.RECORD_AT
    launch.ENABLED = "monkeypatch" not in request.fixturenames
    launch.RECORD_AT = 1
    yield
    launch.ENABLED, launch.RECORD_AT = saved


@pytest.fixture(autouse=True)
def _seed_and_poison(request):
    """A different (but reproducible) seed per test, and NaN-filled torch.empty: any output element a
    kernel fails to write stays NaN, and every test checks for NaN."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(prev)


@pytest.fixture
def force_kernels():
    """``force_kernels(forward=..., backward=...)``: the kernel choice of ``dispatch.force`` for the
    rest of the test ("triton" or a Gluon variant name)."""
    import contextlib

    from triflash.kernels import dispatch

    with contextlib.ExitStack() as stack:
        yield lambda **choice: stack.enter_context(dispatch.force(**choice))


@pytest.fixture
def launched(monkeypatch):
    """The Triton kernels launched from here on, in order: each kernel's name, with +zero_dq when the
    backward's preprocess zeroes the atomic dQ workspace, +atomic_dq when the dK/dV kernel adds dQ
    with atomics, +single for the single-launch backward (monkeypatch also switches plans off, so
    every call launches)."""
    from triflash.kernels import launch

    names = []
    real = launch.run
    flags = (("ZERO_DQ", "+zero_dq"), ("ATOMIC_DQ", "+atomic_dq"), ("SINGLE", "+single"))

    def spy(kernel, grid, *args, **kwargs):
        names.append(kernel.fn.__name__ + "".join(tag for flag, tag in flags if kwargs.get(flag)))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "run", spy)
    return names

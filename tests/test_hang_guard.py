"""The suite's hang guard (conftest.py, ``_hang_guard``): a test that runs past TRIFLASH_TEST_TIMEOUT
seconds ends its process with every thread's stack, instead of holding the run."""

import os
import subprocess
import sys
import time

# The guard's limit in these runs: 12 s, far below the stuck test's 120 s sleep and well above what the
# nested pytest's imports take on a loaded 2-core machine (at 3 s they were cut off mid-import).


def test_a_test_past_the_time_limit_fails_with_its_stack(tmp_path):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "test_stuck.py").write_text("import time\n\n\ndef test_stuck():\n    time.sleep(120)\n")
    env = dict(os.environ, TRIFLASH_TEST_TIMEOUT="12",
               PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    # conftest.py loaded as a plugin (-p), so its autouse guard applies to the stuck test.
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
                          "-q", "--rootdir", str(tmp_path), str(tmp_path / "test_stuck.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert elapsed < 100, elapsed             # far short of the test's 120 s sleep
    assert "Timeout (0:00:12)!" in run.stderr
    assert "test_stuck" in run.stderr         # the stack names the stuck test
    assert "1 passed" not in run.stdout


def _run_with_conftest(tmp_path, files: dict, *args, timeout=110, **env_extra):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]), **env_extra)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
                           "--rootdir", str(tmp_path), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_stop_at_first_failure_under_xdist(tmp_path):
    """``pytest -n 2 -x`` with this suite's conftest reports the stop (it crashed with "I/O operation on
    closed file" while the controller's capture was suspended for the guard)."""
    run = _run_with_conftest(tmp_path, {"test_fails.py": "def test_a():\n    assert False\n\n\n"
                                                         "def test_b():\n    pass\n"}, "-n", "2", "-x")
    assert run.returncode in (1, 2), run.stdout + run.stderr        # 2: xdist reports the stop as an interrupt
    assert "closed file" not in run.stdout + run.stderr
    assert "1 failed" in run.stdout


def test_a_stuck_test_under_xdist_fails_and_the_run_goes_on(tmp_path):
    """Under xdist the guard runs in the workers: the stuck test's worker ends, the other test passes."""
    run = _run_with_conftest(tmp_path, {"test_stuck.py": "import time\n\n\ndef test_stuck():\n    time.sleep(120)\n\n\n"
                                                         "def test_fine():\n    pass\n"}, "-n", "2",
                             TRIFLASH_TEST_TIMEOUT="12")
    assert run.returncode != 0
    assert "Timeout (0:00:12)!" in run.stdout + run.stderr
    assert "1 passed" in run.stdout

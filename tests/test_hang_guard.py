"""The suite's hang guard (conftest.py, ``_hang_guard``): a test that runs past TRIFLASH_TEST_TIMEOUT
seconds ends its process with every thread's stack, instead of holding the run."""

import os
import subprocess
import sys
import time


def test_a_test_past_the_time_limit_fails_with_its_stack(tmp_path):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "test_stuck.py").write_text("import time\n\n\ndef test_stuck():\n    time.sleep(120)\n")
    env = dict(os.environ, TRIFLASH_TEST_TIMEOUT="3",
               PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    # conftest.py loaded as a plugin (-p), so its autouse guard applies to the stuck test.
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
                          "-q", "--rootdir", str(tmp_path), str(tmp_path / "test_stuck.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert elapsed < 100, elapsed             # far short of the test's 120 s sleep
    assert "Timeout (0:00:03)!" in run.stderr
    assert "test_stuck" in run.stderr         # the stack names the stuck test
    assert "1 passed" not in run.stdout

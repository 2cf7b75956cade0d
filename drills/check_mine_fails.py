"""CI check: the untouched drills/mine/ makes every drill test fail, and fail for the right reason.

1. drills/mine/ must be exactly what ``make_mine.py`` builds from drills/solutions/ (no stale stub);
2. pytest runs every drill test file against mine/ (``--target mine``); every test must be collected,
   must FAIL (not pass, not skip, not error in collection) and its failure must say "not written yet".
   So no test is empty: each one reaches a drill's kernel.

    python drills/check_mine_fails.py        (exit 0: all good; 1: a test passed, errored or is missing)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

DRILLS = Path(__file__).resolve().parent
ROOT = DRILLS.parent
NOT_DRILL_TESTS = {"test_lessons.py"}      # checks the lessons, not a kernel


def main() -> int:
    sys.path.insert(0, str(DRILLS))
    import make_mine

    if make_mine.main(["--check"]) != 0:
        return 1
    files = sorted(p for p in (DRILLS / "tests").glob("test_*.py") if p.name not in NOT_DRILL_TESTS)
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "mine.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--target", "mine",
               f"--junitxml={report}", *map(str, files)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
        if proc.returncode != 1 or not report.exists():
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
            print(f"pytest against mine/ exited {proc.returncode}; expected 1 (tests failed)")
            return 1
        per_file: dict[str, list] = {p.stem: [] for p in files}
        for case in ET.parse(report).getroot().iter("testcase"):
            module = case.get("classname", "").split(".")[-1]
            failure = case.find("failure")
            per_file.setdefault(module, []).append(case.get("name"))
            if failure is None:
                kind = "skipped" if case.find("skipped") is not None else (
                    "errored" if case.find("error") is not None else "PASSED")
                problems.append(f"{module}::{case.get('name')} {kind} against the untouched mine/")
            elif "not written yet" not in (failure.get("message", "") + (failure.text or "")):
                problems.append(f"{module}::{case.get('name')} failed, but not with 'not written yet'")
    for module, cases in per_file.items():
        if not cases:
            problems.append(f"{module}: no test collected")
        else:
            print(f"{module}: {len(cases)} tests, all fail against mine/ with 'not written yet'"
                  if not any(p.startswith(module + "::") for p in problems) else f"{module}: see below")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""Build drills/mine/ from drills/solutions/: every @triton.jit function keeps its signature, docstring and
"# Plan:" comments (turned into TODO comments); the rest of its body is replaced by a stub that fails
with "not written yet". Host code (launchers) is kept as is.

    python drills/make_mine.py            write drills/mine/*.py (overwrites your work: asks first)
    python drills/make_mine.py --check    exit 1 if drills/mine/ differs from what would be written (CI)
    python drills/make_mine.py --force    write without asking
    python drills/make_mine.py --only t5_flash_attn   reset one drill
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

DRILLS = Path(__file__).resolve().parent
SOLUTIONS, MINE = DRILLS / "solutions", DRILLS / "mine"
HEADER = ("# Your copy of this drill. Write the bodies marked TODO, then run\n"
          "#     python -m pytest drills/tests/{test}\n"
          "# The lesson: drills/content/en/{name}.md (中文: drills/content/zh/{name}.md).\n"
          "# Reset this file to the untouched stub: python drills/make_mine.py --only {name}\n")


def _is_jit(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).endswith("jit") for d in node.decorator_list)


def stub(source: str, name: str) -> str:
    lines = source.splitlines()
    tree = ast.parse(source)
    out, cursor = [], 0
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and _is_jit(node)):
            continue
        doc = node.body[0]
        assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), f"{node.name}: no docstring"
        body_start = doc.end_lineno                       # 0-based index of the first line after the docstring
        out.extend(lines[cursor:body_start])
        indent = " " * node.body[0].col_offset
        plan = []
        i = body_start
        while i < node.end_lineno and lines[i].strip().startswith("#"):
            text = lines[i].strip()
            if text.startswith("# [drill:"):
                break
            plan.append(text)
            i += 1
        assert plan and plan[0] == "# Plan:", f"{node.name}: the body must start with a '# Plan:' comment block"
        out.append(f"{indent}# TODO: write this function. What it computes:")
        out.extend(f"{indent}{line}" for line in plan[1:])
        out.append(f"{indent}# Delete the line below when you start; the tests will then run your code.")
        out.append(f'{indent}tl.static_assert(False, "{node.name}: not written yet")')
        cursor = node.end_lineno
    out.extend(lines[cursor:])
    return HEADER.format(name=name, test=f"test_{name}.py") + "\n".join(out) + "\n"


def expected() -> dict[Path, str]:
    files = {MINE / "__init__.py": ""}
    for path in sorted(SOLUTIONS.glob("*.py")):
        if path.name != "__init__.py":
            files[MINE / path.name] = stub(path.read_text(), path.stem)
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--only", help="one drill name, e.g. t5_flash_attn")
    args = ap.parse_args(argv)
    files = expected()
    if args.only:
        files = {p: t for p, t in files.items() if p.stem == args.only}
        if not files:
            ap.error(f"no drill named {args.only!r}")
    if args.check:
        stale = [p.name for p, t in files.items() if not p.exists() or p.read_text() != t]
        if stale:
            print(f"drills/mine/ is not the untouched stub of drills/solutions/: {', '.join(stale)}\n"
                  f"run: python drills/make_mine.py --force", file=sys.stderr)
            return 1
        print(f"drills/mine/: {len(files)} files match drills/solutions/")
        return 0
    changed = [p for p, t in files.items() if p.exists() and p.read_text() != t]
    if changed and not args.force:
        answer = input(f"overwrite {', '.join(p.name for p in changed)} in drills/mine/? [y/N] ")
        if answer.strip().lower() != "y":
            return 1
    MINE.mkdir(exist_ok=True)
    for p, t in files.items():
        p.write_text(t)
    print(f"wrote {len(files)} files in drills/mine/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

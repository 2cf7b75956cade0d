"""Line-range citations in the lessons, and the marker comments they point at.

A solution file marks a block of code with two comments:

    # [drill:t5:online-softmax]
    ...the block...
    # [/drill:t5:online-softmax]

A lesson cites it as `t5:online-softmax` (L70-77): the lines strictly between the two markers. The
prefix before the colon names the drill (t5 -> solutions/t5_flash_attn.py). tests/test_lessons.py
checks every citation; after editing a solution, run

    python drills/citations.py --fix       rewrite every lesson's line numbers to the markers' lines
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DRILLS = Path(__file__).resolve().parent
SOLUTIONS = DRILLS / "solutions"
CONTENT = DRILLS / "content"
CITE = re.compile(r"`(?P<name>(?P<drill>[a-z][a-z0-9]*):[a-z0-9-]+)` \(L(?P<first>\d+)-(?P<last>\d+)\)")
BEGIN = re.compile(r"^\s*# \[drill:(?P<name>[a-z0-9]+:[a-z0-9-]+)\]\s*$")
END = re.compile(r"^\s*# \[/drill:(?P<name>[a-z0-9]+:[a-z0-9-]+)\]\s*$")


def drill_files() -> dict[str, Path]:
    """'t5' -> solutions/t5_flash_attn.py, for every solution file."""
    return {p.stem.split("_")[0]: p for p in sorted(SOLUTIONS.glob("*.py")) if p.name != "__init__.py"}


def regions(path: Path) -> dict[str, tuple[int, int]]:
    """marker name -> (first, last) 1-based lines strictly between its begin and end comments."""
    found, open_at = {}, {}
    for no, line in enumerate(path.read_text().splitlines(), start=1):
        if m := BEGIN.match(line):
            assert m["name"] not in open_at and m["name"] not in found, f"{path.name}:{no}: {m['name']} twice"
            open_at[m["name"]] = no
        elif m := END.match(line):
            assert m["name"] in open_at, f"{path.name}:{no}: end of {m['name']} without a begin"
            found[m["name"]] = (open_at.pop(m["name"]) + 1, no - 1)
    assert not open_at, f"{path.name}: markers never closed: {sorted(open_at)}"
    return found


def lessons() -> list[Path]:
    return sorted(CONTENT.glob("*/*.md"))


def fix(text: str, all_regions: dict[str, tuple[int, int]]) -> str:
    def sub(m):
        first, last = all_regions.get(m["name"], (0, 0))
        return f"`{m['name']}` (L{first}-{last})"
    return CITE.sub(sub, text)


def all_regions() -> dict[str, tuple[int, int]]:
    out = {}
    for path in drill_files().values():
        out.update(regions(path))
    return out


if __name__ == "__main__":
    if sys.argv[1:] != ["--fix"]:
        sys.exit(__doc__)
    regs = all_regions()
    for lesson in lessons():
        text = lesson.read_text()
        new = fix(text, regs)
        if new != text:
            lesson.write_text(new)
            print(f"updated {lesson.relative_to(DRILLS)}")

"""The lessons (drills/content/{en,zh}/*.md) against the code they describe. Needs no kernel and no GPU.

* every citation `t5:online-softmax` (L70-77) names a marker of that drill's solution file and its lines
  are exactly the lines between the marker's begin and end comments (python drills/citations.py --fix
  renumbers after an edit);
* every marked block of a solution is cited by both the English and the Chinese lesson;
* every line of a ```python excerpt in a lesson occurs in that drill's solution file (no stale copies);
* every triflash name a lesson points at, written `triflash:<name>`, is still defined (a def or an
  assignment) somewhere under src/triflash/ (names only: files may move, names are what lessons cite).
"""

import re
from pathlib import Path

import pytest
from citations import CITE, CONTENT, drill_files, lessons, regions

ROOT = Path(__file__).resolve().parents[2]
DRILLS = drill_files()
LANGS = ("en", "zh")
PY_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
TRIFLASH_NAME = re.compile(r"`triflash:(?P<name>\w+)`")


def lesson_of(path: Path) -> str:
    return path.stem.split("_")[0]


def test_every_drill_has_both_lessons():
    for _drill, sol in DRILLS.items():
        for lang in LANGS:
            assert (CONTENT / lang / f"{sol.stem}.md").exists(), f"missing content/{lang}/{sol.stem}.md"


@pytest.mark.parametrize("lesson", lessons(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_citations_point_at_their_markers(lesson):
    text = lesson.read_text()
    cites = list(CITE.finditer(text))
    assert cites, f"{lesson.name} cites no line range"
    for m in cites:
        assert m["drill"] in DRILLS, f"{m.group(0)}: no solution file for drill {m['drill']!r}"
        regs = regions(DRILLS[m["drill"]])
        assert m["name"] in regs, f"{m.group(0)}: no marker [drill:{m['name']}] in {DRILLS[m['drill']].name}"
        want = regs[m["name"]]
        got = (int(m["first"]), int(m["last"]))
        assert got == want, (f"{lesson.parent.name}/{lesson.name}: {m.group(0)} but the marked lines are "
                             f"L{want[0]}-{want[1]} (python drills/citations.py --fix)")


@pytest.mark.parametrize("drill", sorted(DRILLS))
def test_every_block_is_explained_in_both_languages(drill):
    names = set(regions(DRILLS[drill]))
    for lang in LANGS:
        text = (CONTENT / lang / f"{DRILLS[drill].stem}.md").read_text()
        cited = {m["name"] for m in CITE.finditer(text)}
        missing = names - cited
        assert not missing, f"content/{lang}/{DRILLS[drill].stem}.md never cites {sorted(missing)}"


@pytest.mark.parametrize("lesson", lessons(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_python_excerpts_are_current(lesson):
    code = {line.strip() for line in DRILLS[lesson_of(lesson)].read_text().splitlines()}
    for block in PY_BLOCK.findall(lesson.read_text()):
        for line in block.splitlines():
            if line.strip() and line.strip() != "...":
                assert line.strip() in code, (f"{lesson.parent.name}/{lesson.name}: excerpt line not in the "
                                              f"solution: {line.strip()!r}")


@pytest.mark.parametrize("lesson", lessons(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_triflash_names_exist(lesson):
    names = {m["name"] for m in TRIFLASH_NAME.finditer(lesson.read_text())}
    if not names:
        return
    src_dir = ROOT / "src" / "triflash"
    if not src_dir.is_dir():
        pytest.skip("no src/triflash next to drills/")
    source = "\n".join(p.read_text() for p in src_dir.rglob("*.py"))
    for name in sorted(names):
        assert re.search(rf"^\s*def {name}\b|^{name}\s*=", source, re.M), (
            f"{lesson.parent.name}/{lesson.name}: `triflash:{name}` is not defined anywhere under src/triflash/")

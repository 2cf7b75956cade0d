"""The package's layering, checked from the source: imports point one way (public function ->
autograd -> dispatch -> kernel modules -> shared kernel pieces), with no circles, and no module
reaches into another's underscore names. A change that breaks either fails here, not in review."""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "triflash"

# Kernel modules hold kernels and their launchers, and choose nothing: only dispatch imports them.
LEAVES = {"kernels.forward", "kernels.backward", "kernels.decode", "kernels.merge",
          "kernels.forward_hopper", "kernels.backward_hopper", "kernels.decode_hopper"}


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        yield ".".join(parts), path


def _imports(name, path):
    """(imported module, names taken from it) for every import in the file, function bodies included
    (a lazy import is still an edge of the graph)."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".") if name else []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:            # from . import a, b: each is a module
                    for alias in node.names:
                        yield (f"{target}.{alias.name}" if target else alias.name), []
                    continue
            elif node.module and node.module.startswith("triflash"):
                target = node.module.removeprefix("triflash").lstrip(".")
            else:
                continue
            yield target, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("triflash."):
                    yield alias.name.removeprefix("triflash."), []


def _graph():
    modules = dict(_modules())
    graph = {}
    for name, path in modules.items():
        edges = {}
        for target, names in _imports(name, path):
            # "from .kernels import configs" names a module: the edge goes to it.
            for n in names:
                if f"{target}.{n}".strip(".") in modules:
                    edges.setdefault(f"{target}.{n}".strip("."), [])
            if target in modules:
                edges.setdefault(target, []).extend(n for n in names if f"{target}.{n}" not in modules)
        edges.pop(name, None)
        graph[name] = edges
    return graph


def test_the_module_graph_is_read():
    graph = _graph()
    assert "kernels.dispatch" in graph["autograd"]
    assert "kernels.forward" in graph["kernels.dispatch"]


def test_no_import_circles():
    graph = _graph()
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, {}):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node)


def test_no_module_takes_another_modules_private_names():
    taken = [(src, dst, n) for src, edges in _graph().items() for dst, names in edges.items()
             for n in names if n.startswith("_") and not n.startswith("__")]
    assert taken == [], taken


def test_kernel_modules_are_leaves():
    """Only dispatch imports a kernel module; kernel modules import shared pieces only
    (common, block_ranges, launch, configs, sm90_common, interpreter), never one another."""
    graph = _graph()
    for src, edges in graph.items():
        for dst in edges:
            if dst in LEAVES:
                assert src == "kernels.dispatch", f"{src} imports the kernel module {dst}"
        if src in LEAVES:
            assert not set(edges) & LEAVES, f"{src} imports {set(edges) & LEAVES}"


def test_drills_mine_is_generated_from_the_solutions():
    """drills/mine/ is solutions/ with each kernel body replaced by its TODO list (make_mine.py): a
    solution edited without regenerating mine/ fails here, in the main suite."""
    import importlib.util

    path = SRC.parents[1] / "drills" / "make_mine.py"
    spec = importlib.util.spec_from_file_location("drills_make_mine", path)
    make_mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_mine)
    assert make_mine.main(["--check"]) == 0

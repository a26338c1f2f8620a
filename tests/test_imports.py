"""The one-way import rule of docs/architecture.md, read off the source with `ast`: no import cycle among
the project's modules; `attention/` imports nothing from the other packages; `kvcache/` and `parallel/`
import nothing from `glm53.engine`. Every import statement counts: relative ones, those inside
functions, and those under `if TYPE_CHECKING:`."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("glm53", "attention", "kvcache", "parallel", "experiments")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def _imports(name: str, path: Path, modules) -> set[str]:
    """Project modules `name` imports: `import a.b` -> a.b; `from a import b` -> a.b if that is a module,
    else a (relative imports resolved against the module's package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import a.b.c` of a module a.b.c, or a name in a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycle(graph) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle(graph):
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_checker_sees_a_cycle_and_function_level_imports(tmp_path):
    """The checker itself: an import inside a function (and a relative one) closes a cycle it reports."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from . import b\n")
    b.write_text("def f():\n    from . import a\n")
    mods = {"pkg.a": a, "pkg.b": b}
    g = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert g == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}} and _cycle(g) is not None


# the one edge across the rooms' order: parallel.comm checks the performance model's byte formulas against
# traced programs (docs/architecture.md, rule 4)
ALLOWED = {("parallel.comm", "glm53.perfmodel.traffic")}

MODEL = ("glm53.config", "glm53.layers", "glm53.model", "glm53.api", "glm53.weights", "glm53.perfmodel",
         "glm53.tokenizer")


@pytest.mark.parametrize("rooms,forbidden", [
    (("attention",), ("glm53", "kvcache", "parallel", "experiments")),
    (("kvcache",), ("glm53", "parallel", "experiments")),
    (MODEL, ("glm53.engine", "parallel", "experiments")),
    (("parallel",), ("glm53.engine", "glm53.api", "glm53.weights", "glm53.perfmodel", "experiments")),
    (("glm53.engine",), ("experiments",)),
])
def test_rooms_import_only_downward(graph, rooms, forbidden):
    """docs/architecture.md's order: attention < kvcache < the model < parallel < glm53.engine < experiments
    (parallel reaches into the model only for the layers it shards, and into the performance model only
    for the byte formulas it checks: ALLOWED)."""
    def inside(m, names):
        return any(m == n or m.startswith(n + ".") for n in names)

    bad = {m: sorted(t for t in targets if inside(t, forbidden) and (m, t) not in ALLOWED)
           for m, targets in graph.items() if inside(m, rooms)}
    assert not {m: t for m, t in bad.items() if t}, bad


def test_the_allowed_edges_lead_to_leaf_modules(graph):
    """An allowed edge may not pull a room in behind it: its target imports nothing of the project."""
    assert {t: sorted(graph[t]) for _, t in ALLOWED} == {t: [] for _, t in ALLOWED}

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


# ------------------------------------------------------------------------------------ the runner's shape
RUNNER = REPO / "glm53" / "engine" / "runner"
MAX_LINES = 400


def _docstrings(tree) -> set[int]:
    """ids of the Constant nodes that are docstrings (a module's, class's or function's first statement)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _words(source: str) -> list[tuple[int, str]]:
    """(line, text) of every identifier and string in `source`'s code, docstrings and comments aside
    (comments are not in the syntax tree): names, attributes, arguments, keywords, definitions, imports
    and string constants (f-strings' literal parts included)."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            out.append((line, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((line, node.attr))
        elif isinstance(node, ast.arg):
            out.append((line, node.arg))
        elif isinstance(node, ast.keyword) and node.arg:
            out.append((line, node.arg))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((line, node.name))
        elif isinstance(node, ast.alias):
            out.append((line, node.name))
            out.extend([(line, node.asname)] if node.asname else [])
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((line, node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            out.append((line, node.value))
    return out


def _policy_words(source: str, word: str = "hisparse") -> list[tuple[int, str]]:
    return [(line, w) for line, w in _words(source) if word in w.lower()]


def test_the_word_checker_sees_code_and_skips_docstrings_and_comments():
    """The checker itself: an identifier, a keyword, an attribute or a string naming the policy is found;
    the same word in a docstring or a comment is not."""
    clean = '"""HiSparse in a docstring."""\ndef f(x):\n    """hisparse too."""\n    return x  # HiSparse\n'
    assert _policy_words(clean) == []
    for code in ("hisparse = 1\n", "f(hisparse=1)\n", "x.hisparse\n", "y = 'kv_policy == hisparse'\n",
                 "def f(HiSparseRow): pass\n", "from kvcache.hisparse import x\n", "y = f'{x} HiSparse'\n"):
        assert _policy_words(code), code


def test_the_runner_is_a_package_of_small_files_that_never_names_a_policy():
    """Issue 50's checks on the runner: it lives in glm53/engine/runner/ (no runner.py beside it); every
    file of it, and the ModelRunner class, under 400 lines; no identifier or string of its code names
    "hisparse" (the policy's device half is kvcache.policies, reached through one interface); one execute
    path (no `_execute_mtp`)."""
    assert RUNNER.is_dir() and not (REPO / "glm53" / "engine" / "runner.py").exists()
    files = sorted(RUNNER.rglob("*.py"))
    assert files
    long = {p.name: n for p in files if (n := len(p.read_text().splitlines())) >= MAX_LINES}
    assert not long, long
    classes = [node for p in files for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.ClassDef) and node.name == "ModelRunner"]
    assert len(classes) == 1 and classes[0].end_lineno - classes[0].lineno + 1 < MAX_LINES
    named = {p.name: hits for p in files if (hits := _policy_words(p.read_text()))}
    assert not named, named
    mtp = {p.name for p in files if any(w == "_execute_mtp" for _, w in _words(p.read_text()))}
    assert not mtp, mtp


# ------------------------------------------------------------------------ the engine reaches policies only
ENGINE = REPO / "glm53" / "engine"


def _policy_branches(source: str) -> list[tuple[int, str]]:
    """(line, what) of each comparison (==, !=, in, not in) with `kv_policy` as an operand and each name of
    a registered policy's class (or a class named after a policy) in `source`'s code."""
    from kvcache.policies import REGISTRY

    classes = {c.__name__ for c in REGISTRY.values()} | {"HiSparsePolicy", "OffloadPolicy", "SwapPolicy",
                                                        "PreemptPolicy", "HiSparseSpec", "HiSparseDevice"}
    tree = ast.parse(source)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Attribute) and o.attr == "kv_policy" or isinstance(o, ast.Name) and o.id == "kv_policy"
                   for o in operands):
                out.append((node.lineno, "compares kv_policy"))
    out += [(line, w) for line, w in _words(source) if w in classes]
    return out


def test_the_policy_checker_sees_a_branch_and_a_class_name():
    assert _policy_branches("if d.kv_policy == 'swap': pass\n") and _policy_branches("x = kv_policy in ('a',)\n")
    assert _policy_branches("from kvcache.policies.swap import SwapPolicy\n")
    assert not _policy_branches("p = d.policy.make(d)\nname = d.kv_policy\n")


def test_the_engine_reaches_policies_only_through_the_registry():
    """Issue 50's check: no code under glm53/engine/ (docstrings and comments aside) compares kv_policy or
    names a concrete policy class; the engine asks `DeployConfig.policy` (kvcache.policies.REGISTRY)."""
    found = {str(p.relative_to(REPO)): hits for p in sorted(ENGINE.rglob("*.py"))
             if (hits := _policy_branches(p.read_text()))}
    assert not found, found

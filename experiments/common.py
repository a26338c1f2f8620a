"""Helpers every experiment shares that must not import JAX (some scripts set the CPU device count
before JAX initialises)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# XLA:CPU maps memory regions for every loaded executable (about 3 per compiled kernel) and keeps them
# while JAX's caches hold it; a long-lived process (an xdist worker, a long sweep) compiles thousands of
# programs and crosses the kernel's vm.max_map_count (65,530 here), after which XLA segfaults or aborts inside a compile
# ("LLVM compilation error: Cannot allocate memory"; docs/testing.md). A sweep drops them between points
# past MAX_MAPS, or past MAPS_SHARE of a higher limit (`sweep_map_budget`).
MAX_MAPS = 20_000
MAPS_SHARE = 0.3

# XLA:CPU with LLVM at -O0 and without its expensive passes: compiles about a quarter faster (more under
# 16 simulated devices) and runs tiny programs about as fast; the test suite and the tests' subprocesses
# use it (tests/conftest.py, docs/testing.md).
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def with_fast_compile(xla_flags: str) -> str:
    """`xla_flags` (an XLA_FLAGS value) with FAST_COMPILE_XLA_FLAGS added unless it sets the level itself."""
    if "--xla_backend_optimization_level" in xla_flags:
        return xla_flags
    return f"{xla_flags} {FAST_COMPILE_XLA_FLAGS}".strip()


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a Python child that imports this checkout (REPO first on its
    PYTHONPATH), with `extra` set."""
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def compile_flags(xla_flags: str) -> str:
    """`xla_flags` (an XLA_FLAGS value) without the simulated device count: the flags that decide how
    programs compile (a CPU spec fitted under them prices programs compiled under them)."""
    return " ".join(f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count"))


def sweep_map_budget() -> int:
    """The mappings a sweep process may hold before it drops JAX's caches between points: MAX_MAPS, or
    MAPS_SHARE of vm.max_map_count where that is more (a machine whose limit was raised keeps a sweep's
    warmed programs; a point compiles at most some tens of thousands more)."""
    from glm53.engine.runner.compilation import max_map_count  # imports JAX: not before the caller's XLA_FLAGS

    return max(MAX_MAPS, int(MAPS_SHARE * (max_map_count() or 0)))


def bound_memory_maps(limit: int = MAX_MAPS) -> bool:
    """Drop JAX's caches (their executables and mappings) once the process holds more than `limit`
    mappings -> whether it did. Call it between units of work (tests, sweep points): what comes next
    compiles its programs again."""
    from glm53.engine.runner.compilation import memory_maps  # imports JAX: not before the caller's XLA_FLAGS

    if memory_maps() <= limit:
        return False
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    return True


_PINNED_REVISION: str | None = None


def pin_revision(rev: str | None) -> None:
    """Make `git_revision` answer `rev` in this process until pinned again (None: ask git again).
    experiments.reproduce pins the revision its run started from: its entries write their results into
    the tree, so each later entry's own question would read "+dirty" for the outputs of the ones before."""
    global _PINNED_REVISION
    _PINNED_REVISION = rev


def git_revision() -> str:
    """HEAD of the repository the benchmark ran from, with "+dirty" when tracked files differ from it (or
    what `pin_revision` pinned)."""
    if _PINNED_REVISION is not None:
        return _PINNED_REVISION
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_config(path: str | None, overrides=(), *, default=None):
    """An experiment config: `get_config()` of the Python file at `path` (or `default()` when path is None),
    then `--config.KEY.SUB=VALUE` overrides applied in order. VALUE is read as a Python literal, else kept
    as a string; KEY must already exist (a typo fails instead of being ignored), and a value of the wrong
    type fails as ml_collections does."""
    import ast
    import importlib.util

    if path is None:
        if default is None:
            raise ValueError("no config path and no default")
        cfg = default()
    else:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        spec = importlib.util.spec_from_file_location(f"_config_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ValueError(f"config file {path} defines no get_config()")
        cfg = module.get_config()
    for item in overrides:
        key, sep, raw = item.removeprefix("--config.").partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must look like --config.KEY=VALUE")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = getattr(node, p, None)
            if node is None:
                raise ValueError(f"override {item!r}: the config has no {key!r}")
        if leaf not in node:
            raise ValueError(f"override {item!r}: the config has no {key!r} (known: {sorted(node.keys())})")
        if isinstance(node[leaf], tuple) and not isinstance(value, tuple):
            value = tuple(value) if isinstance(value, list) else (value,)
        setattr(node, leaf, value)
    return cfg


def run_json_subprocess(cmd: list[str], *, threads: int, timeout: float = 3600) -> dict:
    """Run `cmd` from the repository root (e.g. an HF-transformers script under another Python) with
    `threads` CPU threads and -> the JSON object on the last line of its stdout."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} {' '.join(cmd[1:3])} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def out_dir_from_cli(argv, prog: str, doc: str, default: str) -> Path:
    """The command line of an experiment whose only option is `--out DIR` (its module docstring is the
    help): parse `argv`, create DIR, return it."""
    import argparse

    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=default, help="directory for the results")
    out = Path(ap.parse_args(argv).out)
    out.mkdir(parents=True, exist_ok=True)
    return out

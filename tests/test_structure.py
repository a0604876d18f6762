"""The house plan (../shared/DESIGN.md "Layout"): imports flow one way, no import circles (function-level
imports included), tools/ are thin front ends without sys.path edits, no source file over 300 lines."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Higher imports lower (or its own level), never the other way: tools -> interop/bench -> engine ->
# checkpoint/data/estimate -> config/parallel -> models -> shims/errors. config sits below data/checkpoint/
# estimate: they read the config, and its validation asks parallel/'s feature modules, never theirs.
LEVELS = [
    (0, ("training.errors", "training.shims")),
    (1, ("models",)),
    (2, ("training.config", "training.parallel")),
    (3, ("training.checkpoint", "training.data", "training.estimate")),
    (4, ("training.engine",)),
    (5, ("training.interop", "training.bench")),
    (6, ("tools", "train")),
]


def level(module: str) -> int | None:
    found = [(lvl, len(prefix)) for lvl, prefixes in LEVELS for prefix in prefixes
             if module == prefix or module.startswith(prefix + ".")]
    return max(found, key=lambda f: f[1])[0] if found else None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> list[Path]:
    return [p for top in ("models", "training", "tools") for p in sorted((ROOT / top).rglob("*.py"))] + \
        [ROOT / "train.py"]


def imports(path: Path) -> set[str]:
    """Every training/models module this file imports, at any depth, also under `if TYPE_CHECKING:` (a type
    named from a higher layer is a dependency too: declare what is needed below, as checkpoint/'s TrainState)."""
    known = {module_name(p) for p in sources()}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & known
            # `from pkg import module` imports the module (pkg/__init__ is already under way: no circle)
            out |= submodules if len(submodules) == len(node.names) else {node.module, *submodules}
    return {m for m in out if m in known}


@pytest.mark.fast
def test_imports_flow_one_way_without_circles():
    graph = {module_name(p): imports(p) for p in sources()}
    upward = [f"{m} (level {level(m)}) imports {d} (level {level(d)})" for m, deps in graph.items()
              for d in deps if level(m) is not None and level(d) is not None and level(d) > level(m)]
    assert not upward, upward

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep not in seen and not start.startswith(dep + "."):  # a package's own __init__ is not a circle
                    seen.add(dep)
                    todo.append(dep)
        return seen

    circles = sorted(m for m in graph if m in reach(m))
    assert not circles, f"modules on an import circle: {circles}"


@pytest.mark.fast
def test_files_are_small_and_tools_thin():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in [*sources(), *sorted((ROOT / "tests").rglob("*.py"))]
            if (n := len(p.read_text().splitlines())) > 300]
    assert not long, long
    edits = [str(p.relative_to(ROOT)) for p in (ROOT / "tools").glob("*.py") if "sys.path" in p.read_text()]
    assert not edits, f"tools that edit sys.path (the package is installed): {edits}"

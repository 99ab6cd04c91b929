"""The package's structure: no import cycle between its subpackages and top-level modules, no
function longer than a screenful, and no side concern wired into the step loop from above."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import raytrain_fast

pytestmark = pytest.mark.unit

PACKAGE = Path(raytrain_fast.__file__).parent
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500
LONG_FILES: dict[str, str] = {}
"""Files allowed over MAX_FILE_LINES, each with the reason (docs/architecture.md names the rule)."""


def _unit(module: str) -> str | None:
    """'raytrain_fast.loop.hooks' -> 'loop'; 'raytrain_fast.cli' -> 'cli'; other packages -> None.

    Every config section lives in the `raytrain_fast.config` package (unit 'config'): every part
    of the package reads the config, so it sits below all of them (the tests below keep it a leaf)."""
    parts = module.split(".")
    if parts[0] != "raytrain_fast" or len(parts) < 2:
        return None
    return parts[1]


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").exists() or (PACKAGE / relative / "__init__.py").exists()


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module this file imports, at any depth (function-level imports count too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(  # `from pkg import module`
                f"{name}.{alias.name}" for alias in node.names
                if name.startswith("raytrain_fast") and _is_module(f"{name}.{alias.name}")
            )
    return found


def import_graph() -> dict[str, set[str]]:
    """unit -> the other units it imports (a unit is a subpackage or a top-level module)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(_module_name(path))
        if unit is None:  # raytrain_fast/__init__.py: the lazy export table only
            continue
        targets = {_unit(name) for name in _imports(path)}
        graph.setdefault(unit, set()).update(t for t in targets if t and t != unit)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_subpackages_and_top_level_modules():
    graph = import_graph()
    assert {"loop", "launch", "sweep", "checkpoint", "metrics"} <= set(graph)  # the graph was really built
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def file_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (a package's face counts as the modules it names)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        graph[module] = {
            name for name in _imports(path)
            if name.startswith("raytrain_fast.") and name != module and _is_module(name)
            and not module.startswith(name + ".")  # a module's own package face runs first anyway
        }
    return graph


def test_no_import_cycle_between_files():
    """A circle of files hidden by a function-level import is still a circle (checkpointing <-> export was one)."""
    graph = file_graph()
    assert len(graph) > 80 and graph["raytrain_fast.loop.train_loop"]  # the graph was really built
    faces = {m for m in graph if (PACKAGE / Path(*m.split(".")[1:]) / "__init__.py").exists()}
    # a package face hands names on; a cycle through one is a cycle of the modules behind it
    through = {m: {t for t in targets if t not in faces} | {
        u for t in targets if t in faces for u in graph[t] if u.startswith(t + ".")}
        for m, targets in graph.items() if m not in faces}
    assert find_cycle(through) is None, f"import cycle: {' -> '.join(find_cycle(through) or [])}"


def test_importing_the_config_imports_no_torch_and_nothing_else_of_the_package():
    """`raytrain-fast runs`, `prepare-data` and the pre-start checks read the config without paying for torch."""
    import subprocess
    import sys

    code = ("import sys, raytrain_fast.config; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'ray.', 'deepspeed')))); "
            "print(sorted(m for m in sys.modules if m.startswith('raytrain_fast.')))")
    heavy, ours = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert heavy == "[]", heavy
    assert "raytrain_fast.config.train" in ours  # the sections were really imported
    outside = [m for m in eval(ours) if not m.startswith(("raytrain_fast.config", "raytrain_fast._", "raytrain_fast.errors"))]
    assert not outside, outside


def test_no_config_section_imports_anything_above_it():
    """The sections are leaves: they import the standard library, yaml and each other, nothing of the package above."""
    allowed = ("raytrain_fast.config", "raytrain_fast._dataclass_yaml", "raytrain_fast.errors")
    sections = sorted((PACKAGE / "config").glob("*.py"))
    assert len(sections) >= 9, sections
    for path in sections:
        ours = {name for name in _imports(path) if name.startswith("raytrain_fast")}
        above = {name for name in ours if not name.startswith(allowed)}
        assert not above, f"{path.name} imports {above}"
        third_party = {name.split(".")[0] for name in _imports(path)} - {"raytrain_fast"}
        assert not third_party & {"torch", "ray", "deepspeed", "numpy", "boto3", "wandb"}, (path.name, third_party)


def test_the_step_loop_imports_nothing_above_it():
    """Sweeps, the launcher, benches and the CLI reach the loop as objects passed in."""
    assert not import_graph()["loop"] & {"sweep", "launch", "bench", "cli", "microbatch", "report", "drills"}


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_is_longer_than_60_lines_and_no_file_longer_than_500():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        name = str(path.relative_to(PACKAGE.parent))
        if len(source.splitlines()) > MAX_FILE_LINES and name not in LONG_FILES:
            long.append(f"{name}: {len(source.splitlines())} lines")
        for node in _functions(ast.parse(source)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)


MAX_RUN_STEPS_LINES = 20


def test_the_step_loop_is_a_short_table_of_contents_and_reads_no_environment():
    """run_steps names the events of a step, in order; each component decides whether the step is its step."""
    steps = (PACKAGE / "loop" / "steps.py").read_text()
    run_steps = [node for node in _functions(ast.parse(steps)) if node.name == "run_steps"]
    assert run_steps, "no run_steps found"
    body = run_steps[0].body[1:]  # after the docstring
    assert body[-1].end_lineno - body[0].lineno + 1 <= MAX_RUN_STEPS_LINES
    assert any(isinstance(node, ast.While) for node in body), "run_steps has no step loop"
    source = steps + (PACKAGE / "loop" / "train_loop.py").read_text()
    for name in ("os.environ.get", "getenv", "RAYTRAIN_FAST_"):
        assert name not in source.replace('os.environ["OMP_NUM_THREADS"]', ""), name
    hooks_source = "".join(path.read_text() for path in [PACKAGE / "loop" / "hooks.py", *(PACKAGE / "drills").glob("*.py")])
    for name in ("os.environ", "getenv"):  # hooks come from the caller, never from a shell variable
        assert name not in hooks_source, name


COMPAT_MODULES = {"raytrain_fast._ray_compat", "raytrain_fast.engine.deepspeed_compat"}


def _private_imports(path: Path) -> set[str]:
    """Modules of Ray or DeepSpeed this file imports whose dotted name has a private part (_internal, _private, _raylet)."""
    return {
        name for name in _imports(path)
        if name.split(".")[0] in ("ray", "deepspeed") and any(part.startswith("_") for part in name.split(".")[1:])
    }


def test_every_reach_into_ray_or_deepspeed_privates_lives_in_a_compat_module():
    """One place per dependency to read when Ray or DeepSpeed moves (pyproject.toml caps both)."""
    found = {_module_name(path): _private_imports(path) for path in sorted(PACKAGE.rglob("*.py"))}
    assert found["raytrain_fast._ray_compat"], "the Ray compat module reaches nothing: the check reads nothing"
    outside = {module: names for module, names in found.items() if names and module not in COMPAT_MODULES}
    assert not outside, outside
    patched = [
        _module_name(path) for path in sorted(PACKAGE.rglob("*.py"))
        if ("__compatible_ops__" in path.read_text() or "DeepSpeedZeroOptimizer" in path.read_text())
        and _module_name(path) not in COMPAT_MODULES
    ]
    assert not patched, f"DeepSpeed is changed outside engine/deepspeed_compat.py: {patched}"

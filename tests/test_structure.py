"""The package's structure: no import cycle between its subpackages and top-level modules, no
function longer than a screenful, and no side concern wired into the step loop from above."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import raytrain_fast

pytestmark = pytest.mark.unit

PACKAGE = Path(raytrain_fast.__file__).parent
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500
LONG_FILES: dict[str, str] = {
    "raytrain_fast/engine/deepspeed_compat.py": "every reach into DeepSpeed's and torch's internals, in the one file a "
    "DeepSpeed or torch upgrade reads (the patches, the private attributes, the checkpoint files' names and conversions)",
}
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


CLI_HELPERS = {
    "raytrain_fast.console": "printing and the argparse helper",
    "raytrain_fast.errors": "the error types it prints",
    "raytrain_fast.storage": "the storage checks before a command starts, redaction of what it prints",
    "raytrain_fast.storage.probe": "a storage probe still running at exit",
    "raytrain_fast.storage.redact": "credentials kept out of what it prints",
    "raytrain_fast.config": "the config reference it prints",
    "raytrain_fast.next_steps": "the commands it prints next",
    "raytrain_fast.downstream.command": "`evaluate`, a command-line tool only (docs/api.md)",
    "raytrain_fast.bench.run": "`bench`, a command-line tool only (docs/api.md)",
    "raytrain_fast.launch.ray_address": "joining the cluster in RAY_ADDRESS for `evaluate`",
}
"""What the command line imports beside the public surface (`raytrain_fast`), each with the reason."""


def test_the_command_line_calls_the_public_api():
    """cli.py parses, calls what `raytrain_fast` exports, and prints: every action goes through the
    public surface (docs/api.md), never around it."""
    imported = {name for name in _imports(PACKAGE / "cli.py") if name.startswith("raytrain_fast")}
    assert "raytrain_fast" in imported, "cli.py does not import the public surface"
    around = sorted(imported - {"raytrain_fast"} - set(CLI_HELPERS))
    assert not around, f"cli.py imports {around} around the public surface: export what it needs from raytrain_fast"


def coordinator_reaches(tree: ast.AST) -> list[str]:
    """Calls on the run's coordinator actor around its one interface (coordinator.py's `Coordinator`):
    its `.actor`, or `<coordinator>.<method>.remote(...)`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "actor" and "coordinator" in ast.unparse(node.value).lower():
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote"
              and isinstance(node.func.value, ast.Attribute) and "coordinator" in ast.unparse(node.func.value.value).lower()):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_side_concerns_are_reached_through_their_one_interface():
    """The coordinator actor is called by coordinator.py's `Coordinator` alone (the driver and the
    workers both hold one), and the metrics' parts are private to `TrainMetrics` (a reach into them,
    `metrics._agreement`, is a private attribute: the compat check below reports it anywhere)."""
    outside = {
        str(path.relative_to(PACKAGE)): found for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "coordinator.py" and (found := coordinator_reaches(ast.parse(path.read_text())))
    }
    assert not outside, f"calls on the coordinator actor outside its interface: {outside}"
    planted = "ray.get(parts.coordinator.actor.post.remote(KEY, message, {}))\nmeasured = ray.get(coordinator.measurements.remote())\n"
    assert {line.split(":")[0] for line in coordinator_reaches(ast.parse(planted))} == {"line 1", "line 2"}
    assert private_attribute_reaches(ast.parse("flags = parts.metrics._agreement.flags")) == ["line 1: parts.metrics._agreement"]


COMPAT_MODULES = {"raytrain_fast._ray_compat", "raytrain_fast.engine.deepspeed_compat"}
DEPENDENCIES = ("ray", "deepspeed", "torch")


def _private_imports(path: Path) -> set[str]:
    """Modules of Ray, DeepSpeed or torch this file imports whose dotted name has a private part
    (_internal, _private, _raylet, _dynamo), and private names imported from their modules."""
    tree = ast.parse(path.read_text(), filename=str(path))
    imported = _imports(path) if path.is_relative_to(PACKAGE) else {  # a planted file: its absolute imports
        name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
        for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
    }
    found = {
        name for name in imported
        if name.split(".")[0] in DEPENDENCIES and any(part.startswith("_") for part in name.split(".")[1:])
    }
    found.update(
        f"{node.module}.{alias.name}" for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in DEPENDENCIES
        for alias in node.names if _private(alias.name)
    )
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


ALLOWED_PRIVATE = {
    "_exit": "os._exit: the standard library's exit without cleanup",
    "_replace": "a namedtuple's documented API (urllib's SplitResult)",
    "_fields": "a namedtuple's documented API",
    "_asdict": "a namedtuple's documented API",
    "_SubParsersAction": "argparse's type of add_subparsers(), in an annotation",
}
"""Underscore names that are a documented part of the standard library's API."""
OWN_OBJECTS = ("self", "cls")


def _dependency_bindings(tree: ast.AST) -> dict[str, str]:
    """Local name -> what it is, for every name bound to Ray, DeepSpeed or torch in the file: an
    import of them, or an assignment (`=`, `with ... as`, `for`, an annotated parameter) from an
    expression rooted in one (`ray.get_runtime_context()`, `engine.optimizer`). Read flow-insensitively
    over the whole file: enough to name the object in a message."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                          for a in node.names if a.name.split(".")[0] in DEPENDENCIES})
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in DEPENDENCIES:
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    bindings = [pair for node in ast.walk(tree) for pair in _bound(node)]
    while True:
        new = {name: origin for target, value in bindings if (origin := _origin(value, names))
               for name in _target_names(target) if name not in names}
        if not new:
            return names
        names.update(new)


def _bound(node: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(target, value) pairs that `node` binds."""
    if isinstance(node, ast.Assign):
        return [(target, node.value) for target in node.targets]
    if isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
        return [(node.target, node.value)]
    if isinstance(node, (ast.For, ast.comprehension)):
        return [(node.target, node.iter)]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [(node.optional_vars, node.context_expr)]
    if isinstance(node, ast.arg) and node.annotation is not None:
        return [(ast.Name(id=node.arg), node.annotation)]
    return []


def _target_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _target_names(element)]
    return []


def _origin(node: ast.AST, names: dict[str, str]) -> str | None:
    """What `node` is when it is rooted in a Ray, DeepSpeed or torch name: 'ray.get_runtime_context()'."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        return names.get(node.value.split(".")[0])
    if isinstance(node, ast.Attribute):
        return (base := _origin(node.value, names)) and f"{base}.{node.attr}"
    if isinstance(node, ast.Call):
        return (base := _origin(node.func, names)) and f"{base}()"
    if isinstance(node, (ast.Subscript, ast.Starred, ast.Await)):
        return (base := _origin(node.value, names)) and f"{base}[]"
    return None


def _receiver_is_own(node: ast.AST, own: set[str]) -> bool:
    """`self`, `cls`, or a name bound to this package's own modules and classes."""
    return isinstance(node, ast.Name) and (node.id in OWN_OBJECTS or node.id in own)


def _own_names(tree: ast.AST) -> set[str]:
    return {
        alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and (getattr(node, "level", 0) or (getattr(node, "module", None) or "").startswith("raytrain_fast")
             or any(a.name.startswith("raytrain_fast") for a in node.names))
        for alias in node.names
    }


def private_attribute_reaches(tree: ast.AST) -> list[str]:
    """`obj._name` (read, written or called) and `getattr/setattr/hasattr/delattr(obj, "_name")`
    on anything but the object itself (`self`, `cls`) or this package's own modules, outside the
    standard library's documented underscore names (ALLOWED_PRIVATE). The object is named when it
    comes from Ray, DeepSpeed or torch; any other is reported too, since an object passed in (a
    DeepSpeed engine, a torch scheduler) cannot be told apart by reading one file."""
    names, own, found = _dependency_bindings(tree), _own_names(tree), []
    strings = _string_bindings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            receiver, attrs = node.value, [node.attr]
            shown = f"{ast.unparse(receiver)}.{node.attr}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2):
            receiver, attrs = node.args[0], [value.split(HOLE)[0] for value in _strings(node.args[1], strings)]
            shown = ast.unparse(node)
        else:
            continue
        attrs = [attr for attr in attrs if _private(attr) or attr == "_"]  # "_" + name: a private name built at run time
        if not attrs or set(attrs) <= set(ALLOWED_PRIVATE) or _receiver_is_own(receiver, own):
            continue
        origin = _origin(receiver, names)
        if origin and origin.startswith("torch.ops"):  # ATen operator names: the dispatcher's, looked up with a default
            continue
        found.append(f"line {node.lineno}: {shown}" + (f" ({origin})" if origin else ""))
    return found


HOLE = "\x00"
"""A value computed at run time inside a string built from parts (an f-string's field, a `+` operand)."""


def _shown(text: str) -> str:
    return repr(text.replace(HOLE, "{...}"))


def _string_bindings(tree: ast.AST) -> dict[str, set[str]]:
    """Name -> the strings it may hold: bound anywhere in the file to a string constant, to one of a
    tuple's or list's (`for name in ("a", "b")`), or to a dict of them (its subscript: one of its values)."""
    bound: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        for target, value in _bound(node):
            if isinstance(value, (ast.Tuple, ast.List, ast.Set)) and isinstance(node, (ast.For, ast.comprehension)):
                values = [element for element in value.elts]
            elif isinstance(value, ast.Dict):
                values = list(value.values)
            else:
                values = [value]
            texts = {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
            for name in _target_names(target) if texts else []:
                bound.setdefault(name, set()).update(texts)
    return bound


def _strings(node: ast.AST, bound: dict[str, set[str]]) -> set[str]:
    """The strings `node` may evaluate to, a run-time part as HOLE: a constant, a name bound to
    constants, a subscript of a dict of them, an f-string, a `+` of such parts; {HOLE} when unknown."""
    if isinstance(node, ast.Constant):
        return {node.value} if isinstance(node.value, str) else {HOLE}
    if isinstance(node, ast.Name):
        return bound.get(node.id, {HOLE})
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        return bound.get(node.value.id, {HOLE})
    if isinstance(node, ast.JoinedStr):
        return {"".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values)}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return {left + right for left in _strings(node.left, bound) for right in _strings(node.right, bound)}
    return {HOLE}


DEPENDENCY_FILE_NAMES = ("zero_pp_rank_", "mp_rank_", "_optim_states", "_model_states", "latest_universal")
"""How DeepSpeed names the files of a save (private: its `_get_ckpt_name` and friends, ds_to_universal's marker)."""


def _built_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string the file writes or builds (constants, f-strings, `+` of parts, a
    HOLE for each run-time part), docstrings aside."""
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
        and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    built = [node for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
             or isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)]
    parts = {id(part) for node in built for part in ast.walk(node) if part is not node}
    bound = _string_bindings(tree)
    whole = [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    return [
        (node.lineno, text) for node in whole + built if id(node) not in docstrings and id(node) not in parts
        for text in _strings(node, bound) if text != HOLE
    ]


def private_names_in_strings(tree: ast.AST) -> list[str]:
    """Strings, written whole or built from parts, that name a private module of Ray, DeepSpeed or
    torch ("ray.data._internal...", e.g. a logger's name), hold a private attribute in a dotted path
    (a state-dict key's "_orig_mod."), or spell DeepSpeed's names for the files of a save."""
    module = re.compile(rf"({'|'.join(DEPENDENCIES)})(\.\w+)+")
    attribute = re.compile(r"(?:^|\.)_[A-Za-z]\w*\.")
    found = []
    for line, text in _built_strings(tree):
        plain = text.replace(HOLE, "x")
        if module.fullmatch(plain) and any(_private(part) for part in plain.split(".")[1:]):
            found.append(f"line {line}: {_shown(text)} (a private module)")
        elif attribute.search(plain) and not plain.startswith("raytrain_fast"):
            found.append(f"line {line}: {_shown(text)} (a private attribute in a dotted name)")
        elif any(name in plain for name in DEPENDENCY_FILE_NAMES):
            found.append(f"line {line}: {_shown(text)} (DeepSpeed's name for a file of its save)")
    return found


def script_entry_calls(tree: ast.AST) -> list[str]:
    """Calls of a Ray, DeepSpeed or torch module's `main` (a script's entry point, whose arguments are
    its command line, not an API)."""
    names = _dependency_bindings(tree)
    return [
        f"line {node.lineno}: {origin}" for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "main"
        and (origin := _origin(node.func, names))
    ]


def private_overrides(tree: ast.AST) -> list[str]:
    """Methods with an underscore name defined in a subclass of a Ray, DeepSpeed or torch class,
    where the base has that name (an override of a private method); where the base cannot be
    imported, every such method."""
    names, found = _dependency_bindings(tree), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = [origin for base in node.bases if (origin := _origin(base, names))]
        methods = [f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(f.name)]
        for base in bases if methods else []:
            cls = _import(base)
            found += [f"line {node.lineno}: {node.name}.{m} overrides {base}.{m}" for m in methods if cls is None or hasattr(cls, m)]
    return found


def _import(dotted: str):
    """The object `dotted` names ('torch.nn.Module'), or None."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


ENV_FLAG = re.compile(r"(RAY_|DS_|TORCH|PYTORCH_)\w*")
PUBLIC_FLAGS = {
    "RAY_ADDRESS": "Ray's documented address of the cluster ray.init() joins",
    "DS_ACCELERATOR": "DeepSpeed's documented accelerator override (its accelerator setup guide)",
    "TORCHINDUCTOR_CACHE_DIR": "torch.compile's documented cache directory (its compile-caching recipe)",
}
"""Environment flags of Ray, DeepSpeed and torch that their documentation gives users to set."""


def env_flag_writes(tree: ast.AST) -> list[str]:
    """Writes of a Ray, DeepSpeed or torch environment flag (ENV_FLAG, outside PUBLIC_FLAGS):
    `x["RAY_..."] = ...` (os.environ or an env dict), `{"RAY_...": ...}` (an env dict for Ray's
    runtime_env), `f(RAY_...=...)`, and `.setdefault/.update/.pop/putenv/unsetenv("RAY_...")`.
    Reads (os.environ.get) are not writes."""
    bound = _string_bindings(tree)

    def flag(node: ast.AST | None) -> str | None:  # a constant, or a name held in a variable or built from parts
        values = _strings(node, bound) if node is not None else set()
        return next((v for v in sorted(values) if ENV_FLAG.match(v) and v not in PUBLIC_FLAGS), None)

    found = []
    for node in ast.walk(tree):
        names: list[str | None] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [flag(t.slice) for t in targets if isinstance(t, ast.Subscript)]
        elif isinstance(node, ast.Dict):
            names = [flag(key) for key in node.keys]
        elif isinstance(node, ast.Call):
            names = [k.arg if k.arg and ENV_FLAG.fullmatch(k.arg) and k.arg not in PUBLIC_FLAGS else None for k in node.keywords]
            method = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if method in ("setdefault", "update", "pop", "putenv", "unsetenv", "__setitem__") and node.args:
                names.append(flag(node.args[0]))
        found += [f"line {node.lineno}: {name.replace(HOLE, '{...}')}" for name in names if name]
    return found


def private_reaches(path: Path) -> list[str]:
    """Every reach into Ray, DeepSpeed or torch internals in one file (each check above)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return (
        [f"imports {name}" for name in sorted(_private_imports(path))]
        + [f"{found}: a private attribute" for found in private_attribute_reaches(tree)]
        + [f"{found}: a private name in a string" for found in private_names_in_strings(tree)]
        + [f"{found}: a private method override" for found in private_overrides(tree)]
        + [f"{found}: calls a script's entry point" for found in script_entry_calls(tree)]
        + [f"{found}: sets an internal environment flag" for found in env_flag_writes(tree)]
    )


def assert_reaches_only_in_compat_modules(paths: list[Path]) -> None:
    outside = {
        str(path): found for path in paths
        if (found := private_reaches(path)) and _module_name_or_path(path) not in COMPAT_MODULES
    }
    assert not outside, "reaches into Ray, DeepSpeed or torch internals outside _ray_compat.py and engine/deepspeed_compat.py:\n" + "\n".join(
        f"{path}: {line}" for path, lines in outside.items() for line in lines
    )


def _module_name_or_path(path: Path) -> str:
    return _module_name(path) if path.is_relative_to(PACKAGE) else str(path)


def test_every_reach_into_ray_deepspeed_or_torch_internals_lives_in_a_compat_module():
    """One place per dependency to read when Ray, DeepSpeed or torch moves (pyproject.toml caps
    them): private modules, attributes, method overrides and internal environment flags.

    What the checks see: private imports, `obj._name` and getattr-family calls with a private name
    on anything but `self`/`cls` and this package's own modules, strings that name a private module,
    hold a private attribute in a dotted name or spell DeepSpeed's file names, underscore methods of
    a subclass of their classes that the base has, a call of a script's `main`, and writes of their
    RAY_/DS_/TORCH*/PYTORCH_ environment flags as subscripts, dict keys, keyword arguments and
    setdefault/update/pop calls. A name counts whether written whole, held in a variable (or a
    tuple or dict of them) or built from parts (an f-string, a `+`). What they cannot see: a name
    that arrives from outside the file (a parameter), `obj.__dict__[...]`, an internal attribute
    without an underscore (ZeRO's `clip_grad`), `self._name` inside a subclass for a base attribute
    made in its __init__, and private behaviour reached through a public call."""
    paths = sorted(PACKAGE.rglob("*.py"))
    found = {_module_name(path): private_reaches(path) for path in paths}
    assert found["raytrain_fast._ray_compat"] and found["raytrain_fast.engine.deepspeed_compat"], "the checks read nothing"
    assert_reaches_only_in_compat_modules(paths)
    patched = [
        _module_name(path) for path in paths
        if ("__compatible_ops__" in path.read_text() or "DeepSpeedZeroOptimizer" in path.read_text())
        and _module_name(path) not in COMPAT_MODULES
    ]
    assert not patched, f"DeepSpeed is changed outside engine/deepspeed_compat.py: {patched}"


_PLANTED = """
import argparse
import glob
import logging
import os

import deepspeed
from deepspeed.checkpoint import ds_to_universal
import ray
from ray._private import services
from ray.train.torch import TorchTrainer


class Trainer(TorchTrainer):
    def _register_sigint_handler(self, controller):
        return None


def planted(engine):
    context = ray.get_runtime_context()
    ds_engine, _, _, _ = deepspeed.initialize(model=None)
    os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    env = {"env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}}
    logger = logging.getLogger("ray.train.v2._internal.util")
    return context._private, ds_engine._config, engine.lr_scheduler._last_lr, env, logger, services


FLAG = "RAY_TRAIN_V2_ENABLED"
HIDDEN = {"clip": "_clip_grad"}


def built(engine, state, folder, which, part):
    os.environ[FLAG] = "1"
    os.environ[f"RAY_{which}"] = "0"
    scheduler = getattr(engine.lr_scheduler, "_" + which)
    optimizer = getattr(engine, HIDDEN["clip"])
    weights = {key.removeprefix("_orig_mod."): value for key, value in state.items()}
    shards = glob.glob(f"{folder}/*zero_pp_rank_{part}_mp_rank_00_optim_states.pt")
    logger = logging.getLogger("ray.data." + "_internal")
    ds_to_universal.main(argparse.Namespace(input_folder=folder))
    return scheduler, optimizer, weights, shards, logger
"""
_CLEAN = """
import logging
import os

import ray
from raytrain_fast.coordinator import Coordinator


class Owned:
    def __init__(self):
        self._value = ray.get_runtime_context().get_node_id()

    def value(self):
        return self._value, os.environ.get("RAY_ADDRESS"), {"RAY_ADDRESS": "auto", "DS_ACCELERATOR": "cpu"}


def clean(config, name, layer):
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    fields = {field: getattr(config, field) for field in ("lr", "steps")}
    keys = [f"layers.{layer}.self_attn.q_proj.weight", f"{name}_proj.weight", "model." + name]
    return os._exit, Coordinator, getattr(config, name), fields, keys, "_autobatch"
"""


def test_the_compat_check_fails_on_a_planted_private_reach_outside_the_compat_modules(tmp_path):
    """A module outside the compat modules reaching into Ray and DeepSpeed objects fails the check,
    each reach named; a module using only their public names, its own private attributes and the
    documented flags passes."""
    planted, clean = tmp_path / "planted.py", tmp_path / "clean.py"
    planted.write_text(_PLANTED)
    clean.write_text(_CLEAN)
    assert_reaches_only_in_compat_modules([clean])
    with pytest.raises(AssertionError) as failed:
        assert_reaches_only_in_compat_modules([planted, clean])
    message = str(failed.value)
    assert "clean.py" not in message
    for reach in ("context._private (ray.get_runtime_context())", "ds_engine._config (deepspeed.initialize())",
                  "engine.lr_scheduler._last_lr", "Trainer._register_sigint_handler overrides ray.train.torch.TorchTrainer",
                  "RAY_TRAIN_ENABLE_PRINT_PATCH", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "imports ray._private",
                  "'ray.train.v2._internal.util' (a private module)",
                  # names built at run time: held in a variable, from parts, in an f-string or a pattern
                  "RAY_TRAIN_V2_ENABLED", "RAY_{...}", "getattr(engine.lr_scheduler, '_' + which)",
                  "getattr(engine, HIDDEN['clip'])",
                  "'_orig_mod.' (a private attribute in a dotted name)", "zero_pp_rank_{...}_mp_rank_00_optim_states.pt",
                  "'ray.data._internal' (a private module)", "deepspeed.checkpoint.ds_to_universal.main: calls a script's entry point"):
        assert reach in message, (reach, message)

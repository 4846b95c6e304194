"""Arrows run one way: api → frontend → engine → models → worker / sample → the ground floor
(outputs, sampling_params, config, errors, progress); the commands (cli, gateway.launch) → flags.
Below the front end nothing reads the API's messages (textgen, protobuf, grpc). Inside worker/ each
part names what it may import (kernels at the bottom; the two runners on top, sharing only
step_rows), and a new part must be placed before it passes. Checked on the import statements of
every module, relative ones resolved (imports only for type checkers excepted).

And no loops anywhere: the module import graph of the server, the gateway and the client, every
import counted (type checkers' and functions' too), has no cycle."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GROUND_FLOOR = (
    "inference_service.outputs",
    "inference_service.sampling_params",
    "inference_service.config",
    "inference_service.errors",
    "inference_service.progress",
)
WORKER = "inference_service.worker"
ABOVE_GROUND = tuple(
    f"inference_service.{name}"
    for name in ("frontend", "engine", "api", "worker", "sample", "models", "observability", "cli", "flags")
) + ("gateway",)
# The API's messages and transport: the front end converts them, nothing below it sees them.
API_TYPES = ("textgen", "google.protobuf", "grpc")
# Inside worker/: each part → the other parts it may import (everything else in worker/ is forbidden).
WORKER_PARTS = {
    "kernels": (),
    "step_yield": (),
    "step_rows": (),
    "shard_group": ("kernels",),
    "linears": ("kernels", "shard_group"),
    "attention": ("kernels", "step_yield"),
    "lora": ("kernels", "linears"),
    "weights": ("kernels", "linears"),  # load-time converters over the runtime linears
    "runner": ("attention", "kernels", "linears", "lora", "shard_group", "step_rows", "step_yield"),
    "transformers_runner": ("step_rows",),  # the fallback runner meets the paged one only there
}
# A package (or module) → what it must never import.
FORBIDDEN = {
    **dict.fromkeys(GROUND_FLOOR, ABOVE_GROUND + API_TYPES),
    "inference_service.models": (
        "inference_service.frontend",
        "inference_service.engine",
        "inference_service.api",
        "inference_service.cli",
        "inference_service.flags",
        "gateway",
    )
    + API_TYPES,
    "inference_service.worker": (
        "inference_service.frontend",
        "inference_service.engine",
        "inference_service.api",
        "inference_service.cli",
        "inference_service.flags",
        "inference_service.models",
        "inference_service.sample",
        "gateway",
    )
    + API_TYPES,
    **{
        f"{WORKER}.{part}": tuple(f"{WORKER}.{other}" for other in WORKER_PARTS if other not in allowed + (part,))
        for part, allowed in WORKER_PARTS.items()
    },
    "inference_service.sample": (
        "inference_service.frontend",
        "inference_service.engine",
        "inference_service.api",
        "inference_service.cli",
        "inference_service.flags",
        "inference_service.models",
        "inference_service.worker",
        "gateway",
    )
    + API_TYPES,
    "inference_service.engine": (
        "inference_service.frontend",
        "inference_service.api",
        "inference_service.cli",
        "inference_service.flags",
        "inference_service.observability",
        "gateway",
    )
    + API_TYPES,
    # The servicers sit under the commands; flags build their config from it.
    "inference_service.api": ("inference_service.cli", "inference_service.flags", "gateway"),
    # The front end reads the API's messages, never its servicers; it hands the engine its requests.
    "inference_service.frontend": (
        "inference_service.api",
        "inference_service.cli",
        "inference_service.flags",
        "inference_service.observability",
        "gateway",
    ),
    "inference_service.observability": (
        "inference_service.frontend",
        "inference_service.engine",
        "inference_service.api",
        "inference_service.cli",
        "inference_service.flags",
        "gateway",
    ),
    "inference_service.flags": ("inference_service.cli", "gateway"),
    "gateway": ("inference_service.cli",),
    # The command's entry sits on top of both launch paths; they never reach up to it.
    "gateway.launch": ("gateway.replicated", "gateway.command"),
    "gateway.replicated": ("gateway.command",),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path) -> list[tuple[int, str]]:
    name = _module_name(path)
    return _imports_in(path.read_text(), name if path.name == "__init__.py" else name.rpartition(".")[0])


def _imports_in(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import that runs, wherever it sits (a function's lazy import too);
    a relative import as the absolute name it resolves to from `package`."""
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{source}" if source else base
            found.append((node.lineno, source))
            found += [(node.lineno, f"{source}.{alias.name}") for alias in node.names]
    return found


def _modules() -> list[Path]:
    return sorted(p for folder in ("inference_service", "gateway") for p in (ROOT / folder).rglob("*.py"))


def _upward(name: str, imports: list[tuple[int, str]]) -> list[str]:
    """The imports of module `name` that its rules forbid, as "line N: module"."""
    rules = [forbidden for owner, forbidden in FORBIDDEN.items() if name == owner or name.startswith(owner + ".")]
    return [
        f"line {line}: {module}"
        for line, module in imports
        for forbidden in rules
        for prefix in forbidden
        if (module + ".").startswith(prefix + ".")
    ]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    name = _module_name(path)
    wrong = _upward(name, _runtime_imports(path))
    assert not wrong, f"{name} imports from above it: {wrong}"


def test_every_worker_part_is_placed():
    """A new module or package in worker/ names what it may import (WORKER_PARTS) before it passes."""
    found = {p.stem for p in (ROOT / "inference_service" / "worker").iterdir() if p.suffix == ".py" or p.is_dir()}
    assert found - {"__init__", "__pycache__"} == set(WORKER_PARTS)


@pytest.mark.parametrize(
    ("package", "source", "upward"),
    [
        ("inference_service.engine", "from inference_service.api import server", True),
        ("inference_service.engine", "def f():\n    import inference_service.frontend.openai", True),
        ("inference_service.engine", "from ..frontend import openai", True),  # relative, resolved
        ("inference_service.engine", "from textgen.v1 import generate_pb2", True),
        ("inference_service.worker.kernels", "from ..runner import model_runner", True),
        ("inference_service.worker.linears", "from inference_service.worker.lora import linear", True),
        ("inference_service", "from inference_service.engine import scheduler", True),  # the ground floor
        ("inference_service.engine", "if TYPE_CHECKING:\n    from inference_service.api import server", False),
        ("inference_service.engine", "from inference_service.worker.runner import model_runner", False),
        ("inference_service.api", "from inference_service.engine import async_engine", False),
    ],
)
def test_an_upward_import_is_found(package, source, upward):
    """The check itself can fail: each planted upward import is reported, downward ones are not."""
    name = f"{package}.outputs" if package == "inference_service" else f"{package}.planted"
    assert bool(_upward(name, _imports_in(source, package))) is upward


def test_the_ground_floor_exists_and_is_used():
    """The step contracts live on the ground floor, and the layers below the engine use them there."""
    for module in GROUND_FLOOR:
        assert (ROOT / (module.replace(".", "/") + ".py")).exists()
    users = {
        _module_name(p)
        for p in _modules()
        if any(
            m.startswith(("inference_service.outputs", "inference_service.sampling_params"))
            for _, m in _runtime_imports(p)
        )
    }
    assert {"inference_service.worker.runner.model_runner", "inference_service.sample.sampler"} <= users


# The folders the loop check walks: (where module names start, top-level package).
PACKAGES = ((ROOT, "inference_service"), (ROOT, "gateway"), (ROOT / "clients" / "python", "textgen_client"))


def _import_graph() -> dict[str, dict[str, int]]:
    """module → {module it imports: line}, over every .py file of PACKAGES and every import statement
    (under `if TYPE_CHECKING:` and inside functions too), relative ones resolved. `from pkg import name`
    is an import of the module `pkg.name` when there is one, else of `pkg`; `import a.b.c` is one of
    `a.b.c`, and also of the packages `a` and `a.b` it runs, except the importer's own enclosing
    packages (Python has started them before the importer runs: counting them would make a loop of
    every `__init__` that imports its submodules). Importing one's own package by name (`from pkg
    import __version__`) needs what that `__init__` defines, so it counts."""
    files = {}
    for base, package in PACKAGES:
        for path in sorted((base / package).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:  # the innermost of our modules that `name` is, or is in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    source = f"{base}.{source}" if source else base
                targets = [known(f"{source}.{alias.name}") for alias in node.names]
            else:
                continue
            for target in filter(None, targets):
                enclosing = [target.rsplit(".", n)[0] for n in range(1, target.count(".") + 1)]
                for name in [target] + [p for p in enclosing if p in files and not module.startswith(p + ".")]:
                    if name != module:
                        edges.setdefault(name, node.lineno)
        graph[module] = edges
    return graph


def _loops(graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest cycle through each strongly connected component of more than one module, as
    `module:line → module:line → … → first module` (the line is the import that leads on)."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for name in graph[todo.pop()]:
                if name not in seen:
                    seen.add(name)
                    todo.append(name)
        reach[start] = seen
    components = {frozenset(m for m in reach[start] if start in reach[m]) for start in graph if start in reach[start]}
    loops = []
    for component in sorted(components, key=min):
        start = min(component)
        came_from: dict[str, str] = {}
        todo = deque([start])
        while start not in came_from:  # breadth first inside the component, back to start
            here = todo.popleft()
            for name in graph[here]:
                if name in component and name not in came_from:
                    came_from[name] = here
                    todo.append(name)
        path = [came_from[start]]
        while path[-1] != start:
            path.append(came_from[path[-1]])
        path.reverse()  # start, …, the module that imports start
        steps = [f"{module}:{graph[module][after]}" for module, after in zip(path, path[1:] + [start], strict=True)]
        modules = ", ".join(sorted(component))
        loops.append(" → ".join(steps + [start]) + f"  (all {len(component)} of its modules: {modules})")
    return loops


def test_a_loop_is_found():
    """The loop finder reports a planted cycle (through a type checker's import too) and nothing else."""
    graph = {"a": {"b": 3}, "b": {"c": 5}, "c": {"a": 7}, "d": {"a": 1}}
    assert _loops(graph) == ["a:3 → b:5 → c:7 → a  (all 3 of its modules: a, b, c)"]
    assert _loops({"a": {"b": 1}, "b": {}}) == []


def test_no_import_loops():
    """No module reaches itself through imports, whichever kind (see `_import_graph`)."""
    graph = _import_graph()
    assert {package for _, package in PACKAGES} <= graph.keys() and len(graph) > len(PACKAGES)
    loops = _loops(graph)
    assert not loops, "import loops:\n" + "\n".join(loops)

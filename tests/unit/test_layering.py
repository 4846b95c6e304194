"""Arrows run one way: api → engine → models → worker / sample → the ground floor (outputs,
sampling_params, config, errors); the commands (cli, gateway.launch) → flags. Inside worker/: the
runners → attention, linears → kernels, and weights (load time) → linears; the two runners share
only step_rows. Checked on the import statements of every module (imports only for type checkers
excepted)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GROUND_FLOOR = ("inference_service.outputs", "inference_service.sampling_params", "inference_service.config",
                "inference_service.errors")
WORKER = "inference_service.worker"
ABOVE_GROUND = tuple(f"inference_service.{name}" for name in (
    "engine", "api", "worker", "sample", "models", "observability", "cli", "flags")) + ("gateway",)
# A package (or module) → what it must never import.
FORBIDDEN = {
    **dict.fromkeys(GROUND_FLOOR, ABOVE_GROUND),
    "inference_service.models": ("inference_service.engine", "inference_service.api", "inference_service.cli",
                                 "inference_service.flags", "gateway"),
    "inference_service.worker": ("inference_service.engine", "inference_service.api", "inference_service.cli",
                                 "inference_service.flags", "inference_service.models", "gateway"),
    # Inside worker/: kernels at the bottom, linears and attention over them, weights (load time) over
    # linears, the two runners on top; the runners meet only in step_rows.
    **{f"{WORKER}.{part}": tuple(f"{WORKER}.{other}" for other in others) for part, others in {
        "kernels": ("step_rows", "attention", "linears", "weights", "runner", "transformers_runner"),
        "linears": ("step_rows", "attention", "weights", "runner", "transformers_runner"),
        "attention": ("step_rows", "linears", "weights", "runner", "transformers_runner"),
        "weights": ("step_rows", "attention", "runner", "transformers_runner"),
        "step_rows": ("kernels", "attention", "linears", "weights", "runner", "transformers_runner"),
        "runner": ("weights", "transformers_runner"),
        "transformers_runner": ("weights", "runner"),
    }.items()},
    "inference_service.sample": ("inference_service.engine", "inference_service.api", "inference_service.cli",
                                 "inference_service.flags", "inference_service.models",
                                 "inference_service.worker", "gateway"),
    "inference_service.engine": ("inference_service.api", "inference_service.cli", "inference_service.flags",
                                 "inference_service.observability", "gateway"),
    "inference_service.observability": ("inference_service.engine", "inference_service.cli", "gateway"),
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
    """(line, module) of every import that runs, wherever it sits (a function's lazy import too)."""
    tree = ast.parse(path.read_text())
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
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _modules() -> list[Path]:
    return sorted(p for folder in ("inference_service", "gateway") for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    name = _module_name(path)
    rules = [forbidden for owner, forbidden in FORBIDDEN.items() if name == owner or name.startswith(owner + ".")]
    wrong = [f"line {line}: {module}" for line, module in _runtime_imports(path) for forbidden in rules
             for prefix in forbidden if (module + ".").startswith(prefix if prefix.endswith(".") else prefix + ".")]
    assert not wrong, f"{name} imports from above it: {wrong}"


def test_the_ground_floor_exists_and_is_used():
    """The step contracts live on the ground floor, and the layers below the engine use them there."""
    for module in GROUND_FLOOR:
        assert (ROOT / (module.replace(".", "/") + ".py")).exists()
    users = {_module_name(p) for p in _modules()
             if any(m.startswith(("inference_service.outputs", "inference_service.sampling_params"))
                    for _, m in _runtime_imports(p))}
    assert {"inference_service.worker.runner.model_runner", "inference_service.sample.sampler"} <= users

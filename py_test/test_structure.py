"""The shape of the code: no import circles, layers that point one way, small documented modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "py_src" / "vllm_router"
TESTS = ROOT / "py_test"
MAX_LINES = 300
# Lower layers never import higher ones (engines know nothing of gRPC contracts,
# contracts nothing of the server that hosts them).
LAYERS = [
    {
        "vllm_router",
        "vllm_router.errors",
        "vllm_router.proto",
        "vllm_router.dataclass_flags",
        "vllm_router.contract",
    },
    {"vllm_router.engine"},
    {"vllm_router.serving", "vllm_router.testing"},
    {
        "vllm_router.rpc",
        "vllm_router.convert",
        "vllm_router.responses",
        "vllm_router.vllm_servicer",
        "vllm_router.vllm_grpc",
        "vllm_router.client",
    },
    {"vllm_router.server"},
    {"vllm_router.cli", "vllm_router.client_cli"},
]


def _module_name(path: Path, root: Path, prefix: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([prefix, *parts] if prefix else parts)


def _modules() -> dict[str, Path]:
    found = {
        _module_name(p, PACKAGE, "vllm_router"): p
        for p in PACKAGE.rglob("*.py")
        if "_pb2" not in p.name
    }
    found.update({_module_name(p, TESTS, ""): p for p in TESTS.rglob("*.py")})
    return found


def _is_main_guard(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return (
        isinstance(node, ast.If)
        and isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
    )


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of ours that `name` imports (at any depth, except under `__main__` guards)."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_main_guard(node):
            return
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {t for t in targets if t in known and t != name}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_no_import_cycles() -> None:
    graph = _graph()
    done: set[str] = set()
    cycles: list[list[str]] = []

    def walk(node: str, trail: list[str]) -> None:
        if node in trail:
            cycles.append([*trail[trail.index(node) :], node])
            return
        if node in done:
            return
        for target in sorted(graph[node]):
            walk(target, [*trail, node])
        done.add(node)

    for module in sorted(graph):
        walk(module, [])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _layer(module: str) -> int:
    for level, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names if n != "vllm_router"):
            return level
    assert module == "vllm_router", f"{module} has no layer in LAYERS"
    return 0


def test_layers_point_one_way() -> None:
    upward = [
        f"{source} (layer {_layer(source)}) imports {target} (layer {_layer(target)})"
        for source, targets in _graph().items()
        if source.startswith("vllm_router")
        for target in targets
        if _layer(target) > _layer(source)
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize(
    "path",
    sorted(p for p in PACKAGE.rglob("*.py") if "_pb2" not in p.name and p.stat().st_size),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_modules_are_small_and_say_what_they_own(path: Path) -> None:
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_LINES
    assert ast.get_docstring(ast.parse(source)), f"{path.name} has no opening docstring"

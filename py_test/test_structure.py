"""The shape of the code: no import circles, layers that point one way, contracts as plug-ins
(no contract imports another, one registry mounts them all), small documented modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "py_src" / "vllm_router"
TESTS = ROOT / "py_test"
# A backstop, not a target: a module is as long as its one concern needs.
MAX_LINES = 600
# Lower layers never import higher ones (engines know nothing of gRPC contracts,
# contracts nothing of the server that hosts them).
LAYERS = [
    {
        "vllm_router",
        "vllm_router.errors",
        "vllm_router.proto",
        "vllm_router.dataclass_flags",
        "vllm_router.defaults",
    },
    {"vllm_router.engine"},
    {"vllm_router.core", "vllm_router.testing"},
    {"vllm_router.contracts", "vllm_router.client"},
    {"vllm_router.server"},
    {
        "vllm_router.cli",
        "vllm_router.client_cli",
        "vllm_router.flag_reference",
        "vllm_router.vllm_servicer",
        "vllm_router.__main__",
    },
]
CONTRACTS = PACKAGE / "contracts"
REGISTRY = "vllm_router.server.registry"


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


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of ours that `name` imports (at any depth, `__main__` guards included)."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()

    def visit(node: ast.AST) -> None:
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


def _contract_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "contracts" else None


def test_every_contract_is_a_package_of_the_same_shape() -> None:
    packages = sorted(p.name for p in CONTRACTS.iterdir() if (p / "__init__.py").exists())
    assert len(packages) >= 2, packages
    for name in packages:
        files = {p.name for p in (CONTRACTS / name).glob("*.py")}
        assert {"__init__.py", "servicer.py", "convert.py", "responses.py"} <= files, name


def test_no_contract_imports_another() -> None:
    crossing = [
        f"{source} imports {target}"
        for source, targets in _graph().items()
        if _contract_of(source) is not None
        for target in targets
        if _contract_of(target) not in (None, _contract_of(source))
    ]
    assert not crossing, "\n".join(crossing)


def test_the_server_mounts_contracts_from_one_registry() -> None:
    """Only the registry (and the seed's re-export) names contract servicers; it names all."""
    from vllm_router.server.registry import CONTRACTS as ENTRIES

    graph = _graph()
    importers = {
        source
        for source, targets in graph.items()
        if source.startswith("vllm_router")
        and not source.startswith(("vllm_router.contracts", "vllm_router.client"))
        and any(_contract_of(t) is not None for t in targets)
    }
    assert importers <= {REGISTRY, "vllm_router.vllm_servicer"}, importers
    mounted = {entry.servicer.__module__.split(".")[2] for entry in ENTRIES}
    packages = {p.name for p in CONTRACTS.iterdir() if (p / "__init__.py").exists()}
    assert mounted == packages
    assert len({entry.service_name for entry in ENTRIES}) == len(ENTRIES)


def test_every_rpc_of_every_registered_servicer_maps_its_errors() -> None:
    """Every RPC a contract serves wears `core.handles_errors`: the interceptors map nothing,
    so a handler without it would answer an engine failure as UNKNOWN, uncounted."""
    from vllm_router.core import errors_mapped
    from vllm_router.server.registry import CONTRACTS as ENTRIES

    unmapped = []
    for entry in ENTRIES:
        servicer = entry.servicer
        assert isinstance(servicer, type), entry.service_name
        (generated,) = [c for c in servicer.__mro__ if c.__module__.endswith("_pb2_grpc")]
        rpcs = [name for name, value in vars(generated).items() if callable(value)]
        assert rpcs, f"{generated.__qualname__} lists no RPC"
        unmapped += [
            f"{servicer.__qualname__}.{name}"
            for name in rpcs
            if not errors_mapped(getattr(servicer, name))
        ]
    assert not unmapped, unmapped


@pytest.mark.parametrize(
    "path",
    sorted(p for p in PACKAGE.rglob("*.py") if "_pb2" not in p.name and p.stat().st_size),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_modules_are_small_and_say_what_they_own(path: Path) -> None:
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_LINES
    assert ast.get_docstring(ast.parse(source)), f"{path.name} has no opening docstring"

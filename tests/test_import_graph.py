"""The architecture, checked from the source: three processes that share only the wire, the trainer laid out by
role, and no import cycle. Every import counts, lazy ones inside functions and TYPE_CHECKING ones included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("trainer", "inference", "environments")
# The one import across a process boundary: the trainer's gateway client parses the gateway's wire types.
ALLOWED_CROSSING = {
    ("trainer.training.gateway_client", "inference.wire"),
    ("trainer.service.sampling", "inference.wire"),  # the service samples through the gateway
}
# service: the local Tinker-protocol service, a process of its own that trains with the trainer's code.
# summary: `python -m trainer.summary`, the command for reading a run's or a service client's records (it runs
# trainer.orchestration.summary).
TRAINER_ROLES = {"training", "backends", "orchestration", "service", "summary"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `path` imports (`from pkg import mod` resolves to the module pkg.mod)."""
    found: set[str] = set()
    name_here = module_name(path) if path.is_relative_to(ROOT) else path.stem
    package = name_here if path.name == "__init__.py" else name_here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.split(".")[0] in PACKAGES and name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def test_processes_import_only_their_own_package():
    broken = []
    for module, deps in graph().items():
        own = module.split(".")[0]
        for dep in deps:
            if dep.split(".")[0] != own and (module, dep) not in ALLOWED_CROSSING:
                broken.append(f"{module} imports {dep}")
    assert not broken, "imports across process boundaries (share HTTP or files instead):\n" + "\n".join(
        broken
    )


def test_trainer_is_laid_out_by_role():
    top = {p.name for p in (ROOT / "trainer").iterdir() if p.suffix == ".py"}
    assert top <= {"__init__.py", "__main__.py"}, f"loose modules in trainer/: {sorted(top)}"
    roles = {p.name for p in (ROOT / "trainer").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert roles == TRAINER_ROLES


def find_cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in deps.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in deps:
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycle():
    cycles = find_cycles(graph())
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_a_crossing(tmp_path: Path):
    """The rules above can fail: a module that reaches into another process's package is reported."""
    modules = project_modules()
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f():\n    from trainer.training.config import RunConfig\n    from inference import wire\n"
    )
    assert imports_of(bad, modules) == {"trainer.training.config", "inference.wire"}
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

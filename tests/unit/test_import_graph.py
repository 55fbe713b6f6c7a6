"""The architecture, checked from the source: three processes that share only the wire, the trainer laid out by
role, benchmarks on top of everything, no folder that imports a folder importing it back, and no import cycle. Every import counts, lazy ones inside functions and TYPE_CHECKING ones included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "inference", "environments", "benchmarks", "rlcommon")
# rlcommon/ holds facts every process must agree on, written once (the override parser, the loopback hosts, the
# LoRA-slot formula): it imports no project package, so importing it shares code but couples no process to another.
SHARED = "rlcommon"
# The one import across a process boundary: the trainer's gateway client parses the gateway's wire types.
ALLOWED_CROSSING = {
    ("trainer.training.gateway_client", "inference.wire"),
    ("trainer.service.sampling", "inference.wire"),  # the service samples through the gateway
    ("trainer.orchestration.attach", "inference.wire"),  # a run attaching to a shared engine's gateway
}
# benchmarks/ measures the processes from outside: it may use the trainer's code and the gateway's wire types, and
# nothing in trainer/, inference/ or environments/ imports it.
BENCHMARKS_MAY_IMPORT = ("trainer.", "inference.wire")  # prefixes of module names
# training: the loop and its pure pieces (batches, losses, config, checkpoints, the backend interface it drives).
# backends: the local (PyTorch + PEFT) and Tinker implementations of that interface; the entry point builds one.
# orchestration: starting and supervising a run's processes (launch.sh's launcher, SLURM, pre-flight).
# service: the local Tinker-protocol service, a process of its own that trains with the trainer's code.
# readout: reading run folders and a service client's records (`python -m trainer summary|report`).
# export: taking a trained policy out of a run (`python -m trainer export|serve`).
TRAINER_ROLES = {"training", "backends", "orchestration", "service", "readout", "export"}
# What trainer.training may not import: the roles built on it (it would make the two folders depend on each other).
ABOVE_TRAINING = {
    "trainer.backends",
    "trainer.orchestration",
    "trainer.service",
    "trainer.readout",
    "trainer.export",
}
# Orchestration starts and supervises a run, nothing else: benchmarks live in benchmarks/, readers in readout/.
ORCHESTRATION_MODULES = {
    "__init__",
    "commands",  # the command lines of each process
    "attach",  # a run attached to a shared engine: its lease
    "engine",  # launch.sh engine: a gateway shared by runs
    "dashboard_launch",  # launch.dashboard: the live dashboard beside a run
    "run_api",  # a mixed run's run-api: atroposlib's app plus /envs and re-registration
    "evaluation",  # the evaluate processes of a run, on its schedule
    "eval_cli",  # python -m trainer eval: a gateway and evaluate processes for saved adapters
    "gateway_process",
    "idle",  # why a supervised run is idle
    "launcher",
    "memory_plan",  # will the run fit (pre-flight)
    "model_shape",  # the model's shape the plan reads
    "vllm_memory",  # vLLM's share of the plan
    "compare",  # launch.sh compare: one recipe run on each backend
    "preflight",
    "processes",
    "service_launch",
    "slurm",
    "supervisor",
}
# The gateway's layers, top first: a module may import its own layer and the ones below it, never one above.
# http (body guard, parsing, named-adapter routes) -> samplers (vLLM, Tinker, replicas, solo_lane) -> policy (registry,
# gate, adapter checks, probe check) -> the bottom, which the trainer may share (wire) or anything may use.
INFERENCE_LAYERS: list[tuple[str, set[str]]] = [
    ("top", {"inference.__main__", "inference.app", "inference.verification"}),
    ("http", {"inference.http"}),
    ("samplers", {"inference.samplers"}),
    ("policy", {"inference.policy"}),
    ("bottom", {"inference.wire", "inference.config", "inference.errors", "inference.polling"}),
]


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
            if own == "benchmarks" and dep.startswith(BENCHMARKS_MAY_IMPORT):
                continue
            if dep.split(".")[0] == SHARED:  # every process may use it: it depends on nothing of theirs
                continue
            if dep.split(".")[0] != own and (module, dep) not in ALLOWED_CROSSING:
                broken.append(f"{module} imports {dep}")
    assert not broken, "imports across process boundaries (share HTTP or files instead):\n" + "\n".join(
        broken
    )


def test_rlcommon_imports_no_project_package():
    """What makes rlcommon safe for every process to import: it reaches into none of them."""
    broken = sorted(
        f"{m} imports {d}"
        for m, ds in graph().items()
        if m.split(".")[0] == SHARED
        for d in ds
        if d.split(".")[0] != SHARED
    )
    assert not broken, "rlcommon must stay importable by every process:\n" + "\n".join(broken)


def test_trainer_is_laid_out_by_role():
    top = {p.name for p in (ROOT / "trainer").iterdir() if p.suffix == ".py"}
    assert top <= {"__init__.py", "__main__.py"}, f"loose modules in trainer/: {sorted(top)}"
    roles = {p.name for p in (ROOT / "trainer").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert roles == TRAINER_ROLES


def inference_layer(module: str) -> int | None:
    """Index in INFERENCE_LAYERS of the layer `module` (or the package it is in) belongs to."""
    for depth, (_, members) in enumerate(INFERENCE_LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members):
            return depth
    return None


def upward_imports(deps: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imported in deps.items():
        here = inference_layer(module)
        for dep in imported:
            there = inference_layer(dep)
            if here is not None and there is not None and there < here:
                found.append(
                    f"{module} ({INFERENCE_LAYERS[here][0]}) imports {dep} ({INFERENCE_LAYERS[there][0]})"
                )
    return sorted(found)


def test_inference_is_layered():
    deps = {m: d for m, d in graph().items() if m.split(".")[0] == "inference"}
    # The package files themselves (inference/__init__.py, inference/http/__init__.py, ...) sit in no layer.
    packages = {m for m in deps if (ROOT / m.replace(".", "/") / "__init__.py").exists()}
    unplaced = sorted(m for m in deps if inference_layer(m) is None and m not in packages)
    assert not unplaced, f"inference modules in no layer of INFERENCE_LAYERS: {unplaced}"
    upward = upward_imports(deps)
    assert not upward, "upward imports between the gateway's layers:\n" + "\n".join(upward)
    # vLLM imports its key guard by name inside its own process: the standard library only.
    assert not deps["inference.samplers.vllm_guard"]


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


def test_nothing_the_processes_run_imports_benchmarks():
    users = sorted(
        f"{m} imports {d}"
        for m, ds in graph().items()
        if m.split(".")[0] != "benchmarks"
        for d in ds
        if d.split(".")[0] == "benchmarks"
    )
    assert not users, "benchmarks/ is imported by the code it measures:\n" + "\n".join(users)


def folder_of(module: str) -> str:
    """The folder a module counts for: its trainer role (trainer.training, ...) or its top-level package (the
    trainer's entry point, trainer/__main__.py, counts as `trainer`)."""
    parts = module.split(".")
    if parts[0] == "trainer" and len(parts) > 1 and parts[1] in TRAINER_ROLES:
        return ".".join(parts[:2])
    return parts[0]


def folder_graph(deps: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for module, imported in deps.items():
        here = folder_of(module)
        folders.setdefault(here, set()).update(folder_of(d) for d in imported if folder_of(d) != here)
    return folders


def test_no_folder_imports_a_folder_that_imports_it_back():
    cycles = find_cycles(folder_graph(graph()))
    assert not cycles, f"folders that depend on each other (directly or round a loop): {cycles}"


def training_reaches_up(deps: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {d}"
        for m, ds in deps.items()
        if folder_of(m) == "trainer.training"
        for d in ds
        if folder_of(d) in ABOVE_TRAINING
    )


def test_training_imports_none_of_the_roles_built_on_it():
    """The loop drives the backend interface (trainer/training/backend.py); the entry point builds a backend."""
    reaching = training_reaches_up(graph())
    assert not reaching, "trainer.training imports a role built on it:\n" + "\n".join(reaching)


def test_the_folder_checks_can_fail():
    """A loop that builds its own backend again is reported twice: a folder cycle, and training reaching up."""
    deps = graph()
    deps["trainer.training.loop"] = deps["trainer.training.loop"] | {"trainer.backends.build"}
    assert ["trainer.backends", "trainer.training"] in find_cycles(folder_graph(deps))
    assert training_reaches_up(deps) == ["trainer.training.loop imports trainer.backends.build"]
    assert (
        folder_of("trainer.__main__") == "trainer" and folder_of("inference.http.body_guard") == "inference"
    )


def test_orchestration_holds_only_starting_and_supervising_code():
    folder = ROOT / "trainer" / "orchestration"
    found = {p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.py")}
    assert found == ORCHESTRATION_MODULES, (
        f"not starting/supervising code? new: {sorted(found - ORCHESTRATION_MODULES)}, "
        f"gone: {sorted(ORCHESTRATION_MODULES - found)} (benchmarks go to benchmarks/, readers to trainer/readout/)"
    )


def test_the_checker_sees_a_crossing(tmp_path: Path):
    """The rules above can fail: a module that reaches into another process's package is reported."""
    modules = project_modules()
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f():\n    from trainer.training.config import RunConfig\n    from inference import wire\n"
    )
    assert imports_of(bad, modules) == {"trainer.training.config", "inference.wire"}
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_checker_sees_an_upward_import(tmp_path: Path):
    """The layer rule can fail: a policy module that reaches up into the HTTP layer or the app is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from inference.http.body_guard import BodyGuard\n\n\ndef f():\n    from inference import app, wire\n"
    )
    deps = {"inference.policy.bad": imports_of(bad, project_modules())}
    assert deps["inference.policy.bad"] == {"inference.http.body_guard", "inference.app", "inference.wire"}
    assert upward_imports(deps) == [
        "inference.policy.bad (policy) imports inference.app (top)",
        "inference.policy.bad (policy) imports inference.http.body_guard (http)",
    ]


def test_the_launcher_and_the_gateway_start_without_torch():
    """What starts first imports no ML library: the launcher (every `launch.sh`, before anything is spawned), the
    engine, and the gateway, which reads the model's config.json as JSON before it spawns vLLM. On a 2-core box
    torch was 1.5 s of every launch's critical path, transformers 3.5 s of CPU in every gateway start."""
    heavy = ("torch", "transformers", "peft", "vllm", "numpy")
    code = (
        "import sys\n"
        "import trainer.orchestration.launcher, trainer.orchestration.engine, inference.__main__\n"
        f"print(','.join(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"imported at start: {out.stdout.strip()}"

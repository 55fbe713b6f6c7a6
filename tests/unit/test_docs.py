"""The documentation stays true to the tree: README.md and docs/*.md link only to files and headings that exist,
name only repository paths that exist, and name only config keys the config models define. Fast: reads files and
walks the pydantic models, starts nothing.

A config key is a dotted name in backticks (or a `key=value` word of a command in a code span or code block) whose
first part is a section of the run config (`rollout.max_staleness`, `optim.lr=2e-5`). The run config's
`inference:` section is a free dict there, so `inference.*` keys are looked up in the gateway's own model.
"""

from __future__ import annotations

import importlib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

# The repository root, wherever under tests/ this file lives.
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
README_MAX_LINES = 250

# Top-level folders whose paths the docs may name; a backticked path starting with one of them must exist.
REPO_FOLDERS = tuple("trainer inference environments configs tests docs benchmarks rlcommon .ci".split())
# A dotted word ending in one of these is a file name (`launch.sh`, `metrics.jsonl`), not a config key.
FILE_SUFFIXES = set("sh py md yaml yml json jsonl log toml txt safetensors bin pth".split())
# Placeholders in a path (`adapters/vNNNNNN/`, `runs/<env>-<time>/`, `logs/{a,b}.log`) mean it names no one file.
PLACEHOLDER = re.compile(r"[<>*{}$]|NNN|\.\.\.|\b(?:ENV|FILE|NAME|RUN_DIR|DIR|FOLDER)\b")

KEY_WORD = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(=.*)?$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
FENCE = re.compile(r"^\s*(```|~~~)")


def _run_config_model() -> type[BaseModel]:
    module = importlib.import_module("trainer.training.config")
    return _find_model(module, required={"rollout", "inference", "model"})


def _engine_keys_model() -> type[BaseModel]:
    module = importlib.import_module("trainer.training.config")
    return _find_model(module, required={"engine_url"})


def _gateway_config_model() -> type[BaseModel]:
    module = importlib.import_module("inference.config")
    return _find_model(module, required={"vllm", "publish_token"})


def _find_model(module: types.ModuleType, required: set[str]) -> type[BaseModel]:
    """The module's pydantic model whose fields include `required`: found by shape, not by class name, so a
    renamed class does not break the docs test."""
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, BaseModel) and required <= set(value.model_fields):
            return value
    raise AssertionError(f"{module.__name__} defines no model with fields {sorted(required)}")


def _nested(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the pydantic model inside a field's annotation, whether it is a free mapping that takes any sub-key)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = typing.get_origin(annotation)
    if origin is dict or (isinstance(origin, type) and issubclass(origin, dict)) or annotation is dict:
        return None, True
    for arg in typing.get_args(annotation):
        model, free = _nested(arg)
        if model is not None or free:
            return model, free
    return None, False


@dataclass
class KeyIndex:
    """Which dotted keys the config models define."""

    run: type[BaseModel]
    gateway: type[BaseModel]
    sections: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.sections = set(self.run.model_fields)

    def exists(self, key: str) -> bool:
        first, *rest = key.split(".")
        if (
            first == "inference"
        ):  # the gateway's section, and the run's own keys in it (attaching to an engine)
            return _walk(self.gateway, rest) or _walk(_engine_keys_model(), rest)
        return _walk(self.run, [first, *rest])


def _walk(model: type[BaseModel], parts: list[str]) -> bool:
    if not parts:
        return True
    fields = model.model_fields
    if parts[0] not in fields:
        return False
    nested, free = _nested(fields[parts[0]].annotation)
    if free:
        return True
    if nested is None:
        return len(parts) == 1
    return _walk(nested, parts[1:])


def all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key a model defines, sections included (free mappings end the walk)."""
    keys = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        keys.append(key)
        nested, _ = _nested(info.annotation)
        if nested is not None:
            keys.extend(all_keys(nested, f"{key}."))
    return keys


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in _prose_lines(text):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _paragraphs(text: str) -> list[str]:
    """The prose outside code blocks, one string per paragraph: a code span or link may wrap across lines."""
    paragraphs, current = [], []
    for line in [*_prose_lines(text), ""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return paragraphs


def _code_words(text: str) -> list[tuple[str, str]]:
    """(word, the word before it) for every whitespace-separated word of every code span and code block."""
    chunks: list[str] = []
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif fenced:
            chunks.append(line)
    for paragraph in _paragraphs(text):
        chunks.extend(match.group(2) for match in CODE_SPAN.finditer(paragraph))
    words: list[tuple[str, str]] = []
    for chunk in chunks:
        previous = ""
        for word in chunk.split():
            words.append((word, previous))
            previous = word
    return words


def _check_link(doc: Path, target: str, root: Path) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    path_part, _, anchor = target.partition("#")
    resolved = (doc.parent / path_part).resolve() if path_part else doc
    if not resolved.exists():
        return f"{doc.name}: link {target!r} points to {path_part!r}, which does not exist"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
        return f"{doc.name}: link {target!r}: no heading with anchor #{anchor} in {resolved.name}"
    return None


def _check_path(doc: Path, word: str, root: Path) -> str | None:
    candidate = word.strip(".,;:()'\"`").split("::")[0]
    if "/" not in candidate or PLACEHOLDER.search(candidate) or candidate.startswith("/"):
        return None
    if candidate.split("/")[0] not in REPO_FOLDERS or not (root / candidate.split("/")[0]).is_dir():
        return None
    if not (root / candidate).exists():
        return f"{doc.name}: names path {candidate!r}, which does not exist"
    return None


def _check_module(doc: Path, word: str, previous: str, root: Path) -> str | None:
    """`python -m trainer.x.y`: the module must be there (a file, or a package with __main__.py)."""
    if previous != "-m" or word.split(".")[0] not in REPO_FOLDERS or not (root / word.split(".")[0]).is_dir():
        return None
    path = root.joinpath(*word.split("."))
    if path.with_suffix(".py").is_file() or (path / "__main__.py").is_file():
        return None
    return f"{doc.name}: runs module {word!r} (python -m), which does not exist"


def _check_key(doc: Path, word: str, previous: str, keys: KeyIndex) -> str | None:
    if previous == "-m":  # `python -m trainer.training.x`: a module, not a key
        return None
    match = KEY_WORD.match(word.strip("`").rstrip(".,;:)"))
    if not match:
        return None
    key = match.group(1)
    if key.split(".")[0] not in keys.sections:
        return None
    if match.group(2) is None and key.rsplit(".", 1)[-1] in FILE_SUFFIXES:
        return None
    if not keys.exists(key):
        return f"{doc.name}: names config key {key!r}, which no config model defines"
    return None


def check_doc(doc: Path, root: Path, keys: KeyIndex) -> list[str]:
    text = doc.read_text()
    problems: list[str] = []
    for paragraph in _paragraphs(text):
        for target in LINK.findall(CODE_SPAN.sub("", paragraph)):
            problems.append(_check_link(doc, target, root) or "")
    for word, previous in _code_words(text):
        problems.append(_check_path(doc, word, root) or "")
        problems.append(_check_module(doc, word, previous, root) or "")
        problems.append(_check_key(doc, word, previous, keys) or "")
    return sorted({p for p in problems if p})


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("benchmarks/*.md"))]


def _keys() -> KeyIndex:
    return KeyIndex(run=_run_config_model(), gateway=_gateway_config_model())


def test_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (limit {README_MAX_LINES})"
    )


def test_docs_folder_exists_and_readme_links_it() -> None:
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert docs, "docs/ holds no markdown files"
    readme = (ROOT / "README.md").read_text()
    missing = [d.name for d in docs if f"docs/{d.name}" not in readme]
    assert not missing, f"README.md does not link {missing}"


def test_links_paths_and_config_keys_resolve() -> None:
    keys = _keys()
    problems = [p for doc in _docs() for p in check_doc(doc, ROOT, keys)]
    assert not problems, "\n".join(problems)


def test_configuration_reference_lists_every_key() -> None:
    keys = _keys()
    wanted = [k for k in all_keys(keys.run) if k != "inference" and not k.startswith("inference.")]
    wanted += [
        "inference",
        *all_keys(keys.gateway, "inference."),
        *all_keys(_engine_keys_model(), "inference."),
    ]
    reference = (ROOT / "docs" / "configuration.md").read_text()
    missing = [k for k in wanted if f"`{k}`" not in reference]
    assert not missing, f"docs/configuration.md has no row for {missing} (add: key, type, default, meaning)"


def test_key_index_knows_the_sections() -> None:
    keys = _keys()
    assert {"rollout", "optim", "inference", "publish", "model", "trainer", "launch"} <= keys.sections
    assert keys.exists("rollout.max_staleness")
    assert keys.exists("inference.vllm.max_lora_rank")  # from the gateway's model
    assert keys.exists("rollout.env_args.data_path")  # a free mapping takes any sub-key
    assert not keys.exists("rollout.max_staleness.extra")  # a leaf has no sub-keys
    assert not keys.exists("optim.no_such_key")


def test_checker_reports_broken_links_paths_and_unknown_keys(tmp_path: Path) -> None:
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__main__.py").write_text("")
    (tmp_path / "other.md").write_text("# Other page\n\n## A heading\n")
    doc = tmp_path / "page.md"
    doc.write_text(
        "# Page\n\n"
        "See [the other page](other.md#a-heading), [a missing page](missing.md), [a bad anchor](other.md#nope), "
        "[this page](#page) and [the web](https://example.org).\n\n"
        "Set `optim.lr=2e-5` and `optim.learning_rate`; run `bash launch.sh toy`; "
        "read `trainer/gone.py`, `runs/<env>-<time>/`, `python -m trainer` and `python -m trainer.gone`.\n\n"
        "```bash\nbash launch.sh toy inference.vllm.no_such=1 rollout.num_steps=3\n```\n"
    )
    problems = check_doc(doc, tmp_path, _keys())
    assert len(problems) == 6, problems
    joined = "\n".join(problems)
    for expected in (
        "missing.md",
        "#nope",
        "'optim.learning_rate'",
        "'inference.vllm.no_such'",
        "'trainer/gone.py'",
        "'trainer.gone'",
    ):
        assert expected in joined, (expected, problems)


def test_the_configuration_reference_is_what_the_generator_prints() -> None:
    from trainer.training.config_reference import render, run_tables

    page = (ROOT / "docs" / "configuration.md").read_text()
    generated = render(run_tables())
    assert page == generated, (
        "docs/configuration.md differs from the models: run `.venv/bin/python -m trainer config-reference > "
        "docs/configuration.md` (descriptions are the fields' own; prose is in trainer/training/config_reference.py)"
    )


# What a lab notebook says and a reference does not: the story of particular runs, fixes and sessions. docs/ states
# what the code does; measured figures, with their commands and revisions, live in benchmarks/RESULTS.md.
ANECDOTE = re.compile(
    r"before the fix|a CI run|runs? measured|session notes?|this session|once failed|"
    r"\bin \d+ of \d+ runs\b|\b\d+ runs of \d+\b|\b(?:two|three|four) runs each\b|not explained",
    re.IGNORECASE,
)


def anecdotes(text: str) -> list[str]:
    """The lines of `text` that tell the story of a run rather than what the code does."""
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if ANECDOTE.search(line)]


def test_docs_describe_the_code_not_the_runs() -> None:
    found = [
        f"{doc.name}:{a}"
        for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for a in anecdotes(doc.read_text())
    ]
    assert not found, (
        "move run anecdotes to benchmarks/RESULTS.md (with the command and revision):\n" + "\n".join(found)
    )


def test_the_anecdote_check_sees_a_story() -> None:
    assert anecdotes("On a kept-alive connection the gateway adds 1 ms (44.9 ms before the fix).")
    assert anecdotes("Residue fell to 0 in 2 of 4 runs.")
    assert not anecdotes("The gate holds a request until the version it waits for is published.")

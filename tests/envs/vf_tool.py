"""A tool-using verifiers (v0) environment of our own, offline: verifiers' ToolEnv with one Python tool that counts a
letter in a word. The question asks for the count; the model may call the tool (its answer comes back as a `tool`
turn) before it answers.

    bash launch.sh vf:tests/envs/vf_tool.py --config configs/tiny_cpu.yaml

Reward: the toy task's share of target tokens over the model's turns (tests/envs/vf_toy.py, so a random tiny
model has something to learn), plus 1 for a last reply that contains the right count. The request offers the tool
(`tools=`); vLLM turns the model's text into `tool_calls` only when it runs with a tool call parser
(`--enable-auto-tool-choice --tool-call-parser ...`, through `inference.vllm.extra_args`) that fits the model's
chat template. Without one, or with the random tiny model, a reply carries no tool call and the rollout ends after
it: one sampled turn, trained like a single-turn environment's.

The runner passes the run's tokenizer folder as `tokenizer_name` (this load_environment declares it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import verifiers as vf
from datasets import Dataset
from transformers import AutoTokenizer

WORDS = ["strawberry", "banana", "mississippi", "letter", "bookkeeper", "committee", "parallel", "assessment"]
LETTERS = ["r", "a", "s", "t", "e", "m", "l", "s"]


def load_toy() -> Any:
    """tests/envs/vf_toy.py beside this file (environment files are loaded by path, not as a package)."""
    spec = importlib.util.spec_from_file_location("vf_toy_for_tool", Path(__file__).with_name("vf_toy.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def letter_count(word: str, letter: str) -> int:
    """Count how many times a letter occurs in a word.

    Args:
        word: The word to look in.
        letter: The single letter to count.

    Returns:
        The number of occurrences of the letter in the word.
    """
    if len(letter) != 1:
        raise ValueError(f"letter must be one character, got {letter!r}")
    return word.count(letter)


def last_reply(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    replies = [m for m in completion if (m.get("role") if hasattr(m, "get") else m.role) == "assistant"]
    if not replies:
        return ""
    content = replies[-1].get("content") if hasattr(replies[-1], "get") else replies[-1].content
    return content if isinstance(content, str) else ""


def load_environment(
    tokenizer_name: str,
    target_fraction: float = 0.1,
    target_seed: int = 1234,
    max_new_tokens: int = 16,
    max_turns: int = 3,
) -> vf.Environment:
    toy = load_toy()
    tok = AutoTokenizer.from_pretrained(tokenizer_name)
    eos = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int)}
    targets = toy.target_ids(len(tok), set(tok.all_special_ids) | eos, target_fraction, target_seed)

    def sampled_share(state: Any, **kwargs: Any) -> float:
        steps = [step for step in state["trajectory"] if step.get("tokens") is not None]
        rewards = [
            toy.toy_reward(list(s["tokens"]["completion_ids"]), targets, eos, max_new_tokens) for s in steps
        ]
        return sum(rewards) / len(rewards) if rewards else 0.0

    def right_count(completion: Any, answer: str, **kwargs: Any) -> float:
        return float(answer in last_reply(completion).split())

    rows = [
        {"question": f"How many times does the letter '{c}' occur in '{w}'?", "answer": str(w.count(c))}
        for w, c in zip(WORDS, LETTERS, strict=True)
    ]
    return vf.ToolEnv(
        dataset=Dataset.from_list(rows),
        rubric=vf.Rubric(funcs=[sampled_share, right_count]),
        tools=[letter_count],
        max_turns=max_turns,
    )

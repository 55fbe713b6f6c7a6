"""GSM8K as an Atropos environment: chat prompt per question, `group_size` samples through ManagedServer,
binary reward from math-verify against the gold answer (the number after '####').

Data: the Hugging Face dataset `openai/gsm8k` (config `main`) when the hub or its cache is reachable, or a local
JSONL/parquet file with `question` and `answer` fields (`rollout.env_args.data_path=...`, i.e. --env.data_path).
Without either it fails at once with that instruction rather than waiting on the network.

Eval (`python -m environments.gsm8k evaluate ...`): the test split (`--env.eval_data_path`, or the same dataset's
`eval_split`), in file order, the first eval_max_items of it; each answer scored as in training (1.0 passes).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

from atroposlib.envs.base import BaseEnvConfig, ScoredDataGroup
from pydantic import Field

from environments.common import (
    ResumableData,
    Sampled,
    completion_ids,
    eval_max_new_tokens,
    evaluate_items,
    group_from_nodes,
    hub_reachable,
    run_cli,
)
from environments.evaluation import EvalSettings

SYSTEM_PROMPT = (
    "Solve the math problem step by step. End with the final answer as a number in \\boxed{}, "
    "for example \\boxed{42}."
)
HOW_TO_SUPPLY = (
    'download it where there is network (e.g. `python -c "import datasets; '
    "datasets.load_dataset('openai/gsm8k','main',split='train').to_json('gsm8k_train.jsonl')\"`) and "
    "pass rollout.env_args.data_path=/path/to/gsm8k_train.jsonl (JSONL or parquet with question, answer)"
)
HOW_TO_SUPPLY_EVAL = (
    "download it where there is network (split='test', to_json('gsm8k_test.jsonl')) and pass "
    "--env.eval_data_path=/path/to/gsm8k_test.jsonl (rollout.env_args.eval_data_path in a run's config)"
)


class DataUnavailable(RuntimeError):
    pass


def extract_gold(answer: str) -> str:
    """GSM8K's gold answer is the text after the last '####', with thousands separators removed."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' marker: {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def score_completion(completion: str, gold: str) -> float:
    from math_verify import parse, verify

    try:
        return 1.0 if verify(parse(gold), parse(completion)) else 0.0
    except Exception:  # math-verify raises on unparsable text; an unparsable answer is a wrong answer
        return 0.0


def load_rows(
    data_path: str | None,
    dataset: str,
    config: str,
    split: str,
    flag: str = "data_path",
    how: str = HOW_TO_SUPPLY,
) -> list[dict[str, str]]:
    import datasets

    if data_path:
        path = Path(data_path)
        if not path.is_file():
            raise DataUnavailable(f"--env.{flag} {data_path!r} does not exist")
        kind = "parquet" if path.suffix == ".parquet" else "json"
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    else:
        try:
            ds = datasets.load_dataset(dataset, config, split=split)
        except Exception as exc:  # datasets raises ConnectionError, OSError or its own errors offline
            raise DataUnavailable(
                f"cannot load {dataset}/{config} split {split!r} ({type(exc).__name__}: {exc}); {how}"
            ) from exc
    rows = [{"question": r["question"], "answer": r["answer"]} for r in ds]
    if not rows:
        raise DataUnavailable(f"no rows in {data_path or dataset}")
    return rows


def preflight(flags: dict[str, str]) -> list[str]:
    """Run by launch.sh before starting anything: is there GSM8K data to read? A given eval_data_path must exist
    too; without one, eval reads the test split from the same hub dataset this check already covers."""
    eval_path = flags.get("eval_data_path")
    if eval_path and not Path(eval_path).is_file():
        return [f"rollout.env_args.eval_data_path={eval_path!r} does not exist; {HOW_TO_SUPPLY_EVAL}"]
    data_path = flags.get("data_path")
    if data_path:
        return (
            []
            if Path(data_path).is_file()
            else [f"rollout.env_args.data_path={data_path!r} does not exist; {HOW_TO_SUPPLY}"]
        )
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(flags.get("dataset", "openai/gsm8k"), repo_type="dataset", local_files_only=True)
        return []
    except Exception:  # not cached (the hub library raises several error types for this)
        pass
    if hub_reachable():
        return []
    return [f"GSM8K data is not cached and the Hugging Face hub is unreachable: {HOW_TO_SUPPLY}"]


class GSM8KConfig(BaseEnvConfig, EvalSettings):
    temperature: float = Field(1.0, description="sampling temperature")
    max_new_tokens: int = Field(256, description="completion length limit")
    data_path: str | None = Field(None, description="local JSONL/parquet with question, answer (offline use)")
    dataset: str = Field("openai/gsm8k", description="hub dataset when data_path is unset")
    dataset_config: str = Field("main")
    split: str = Field("train")
    seed: int = Field(42, description="shuffle seed (the reference run used 42, 121212, 65432)")
    eval_data_path: str | None = Field(
        None, description="local JSONL/parquet of the eval set (question, answer)"
    )
    eval_split: str = Field("test", description="eval split of `dataset` when eval_data_path is unset")


class GSM8KEnv(ResumableData):
    name = "gsm8k"
    data_position = ("index",)
    env_config_cls = GSM8KConfig  # type: ignore[assignment]

    default_group_size = 16

    async def setup(self) -> None:
        cfg: Any = self.config
        self.index = 0
        if self.evaluate_only:  # an eval process reads the test split only (evaluate)
            self.rows = []
            return
        self.rows = self.load(cfg.data_path, cfg.split, "data_path", HOW_TO_SUPPLY)
        random.Random(cfg.seed).shuffle(self.rows)

    def load(self, data_path: str | None, split: str, flag: str, how: str) -> list[dict[str, str]]:
        cfg: Any = self.config
        try:
            return load_rows(data_path, cfg.dataset, cfg.dataset_config, split, flag, how)
        except DataUnavailable as exc:
            logging.error("%s", exc)
            raise SystemExit(f"gsm8k: {exc}") from None

    async def get_next_item(self) -> dict[str, str]:
        row = self.rows[self.index % len(self.rows)]
        self.index += 1
        return row

    async def collect_trajectories(self, item: dict[str, str]) -> tuple[ScoredDataGroup | None, list[Any]]:
        cfg: Any = self.config
        nodes, texts, gold = await self.answers(item, cfg.group_size, cfg.max_new_tokens, cfg.temperature)
        return group_from_nodes(nodes, [score_completion(t, gold) for t in texts]), []

    async def answers(
        self, row: dict[str, str], n: int, max_tokens: int, temperature: float, **split: str
    ) -> tuple[list[Any], list[str], str]:
        """n sampled answers to one question (ManagedServer nodes and their texts), and its gold answer: what
        training and evaluation both score."""
        gold = extract_gold(row["answer"])
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": row["question"]},
        ]
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            await managed.chat_completion(
                messages=messages, n=n, max_tokens=max_tokens, temperature=temperature, **split
            )
            nodes = managed.get_state()["nodes"]
        texts = [self.tokenizer.decode(completion_ids(node), skip_special_tokens=True) for node in nodes]
        return nodes, texts, gold

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        cfg: Any = self.config
        rows = self.load(cfg.eval_data_path, cfg.eval_split, "eval_data_path", HOW_TO_SUPPLY_EVAL)
        await evaluate_items(self, rows, self.eval_samples, 1.0, "gsm8k")

    async def eval_samples(self, row: dict[str, str]) -> list[Sampled]:
        cfg: Any = self.config
        _, texts, gold = await self.answers(
            row, cfg.eval_k, eval_max_new_tokens(cfg), cfg.eval_temperature, split="eval"
        )
        return [
            (score_completion(t, gold), {"question": row["question"], "gold": gold, "completion": t})
            for t in texts
        ]


if __name__ == "__main__":
    run_cli(GSM8KEnv, preflight)

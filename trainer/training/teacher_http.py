"""A distillation teacher behind a URL: a running vLLM OpenAI-compatible server (a teacher too large for the
trainer's GPU, served elsewhere), scoring the student's sampled tokens with prompt logprobs.

For each trained sequence the whole prompt+completion goes to POST /v1/completions as token ids with `echo`,
`max_tokens: 0` and `prompt_logprobs: 0`: vLLM answers, per prompt position t, the logprob of token t given tokens
before it (None at t = 0), from the raw distribution (prompt tokens never pass the sampler's temperature or
processors, whatever --logprobs-mode says, unless it is one of the *_logits modes, which answer logits: refused).
The request-building and answer-mapping helpers are pure; UrlTeacher adds the HTTP, retried like the trainer's
other calls (trainer/training/retries.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from trainer.training.batch import TrainingExample, plan_micro_batches
from trainer.training.config import TEACHER_API_KEY_ENV, ConfigError, DistillConfig, RunConfig
from trainer.training.retries import ComponentDown, RemoteComponent, checked, describe

# Below any logprob a model gives (a float32 softmax floors near -1e2; a vocabulary of 10^6 with one dominant logit
# of +1e3 gives about -2e3): a value under it is a broken or hostile answer, not a probability.
LOWEST_LOGPROB = -1e4
MAX_ANSWER_BYTES = 256 * 2**20  # a teacher answer is a few hundred bytes per token: far below this
# A few strings whose ids must come out the same from both tokenizers (pre-flight): words, digits, whitespace,
# punctuation and non-ASCII text, where tokenizers of different families part ways.
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? Answer: 42\n\n  Indented\tline",
    "def f(x):\n    return x ** 2  # squared",
    "Ünïcödé, 日本語, emoji 🙂 and symbols: <>{}[]|~^`",
)
PROBE_CHAT = [{"role": "user", "content": "What is 3 + 4?"}]


def server_root(url: str) -> str:
    """The server's root (where /health and /tokenize live) from distill.teacher, which may end in /v1."""
    root = url.rstrip("/")
    return root.removesuffix("/v1")


def full_sequence(example: TrainingExample) -> list[int]:
    """The tokens the example trains on, prompt+completion: its inputs, then its last target."""
    if not example.input_ids or example.input_ids[1:] != example.target_ids[:-1]:
        raise ValueError(
            f"example of group {example.group_index}, sequence {example.sequence_index}: its targets are not its "
            "inputs shifted by one, so it is not one prompt+completion a teacher can score"
        )
    return [*example.input_ids, example.target_ids[-1]]


def completion_request(model: str, sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
    """One /v1/completions body scoring `sequences` (token ids; one choice each, in order): nothing generated
    (`max_tokens: 0` with `echo`), each prompt token's own logprob only (`prompt_logprobs: 0`), the prompt ids
    echoed back (`return_token_ids`, which also spares the server detokenizing them)."""
    return {
        "model": model,
        "prompt": [list(s) for s in sequences],
        "echo": True,
        "max_tokens": 0,
        "prompt_logprobs": 0,
        "return_token_ids": True,
        "temperature": 1.0,  # not applied to prompt logprobs; set so that no server default can matter
        "n": 1,
    }


def target_logprobs(example: TrainingExample, choice: Mapping[str, Any], where: str) -> list[float]:
    """The teacher's logprob of each target of `example` from one answer choice (0.0 at untrained targets):
    target t is token t + 1 of the sequence, whose logprob given tokens[: t + 1] is prompt_logprobs[t + 1]."""
    seq = full_sequence(example)
    echoed, rows = choice.get("prompt_token_ids"), choice.get("prompt_logprobs")
    if rows is None:
        raise TeacherServerError(
            f"{where}: the answer has no prompt_logprobs; distill.teacher must be a vLLM OpenAI-compatible server "
            "(other servers do not return prompt logprobs)"
        )
    if echoed is not None and list(echoed) != seq:
        raise TeacherServerError(
            f"{where}: the server scored other tokens than sent ({len(echoed)} ids back for {len(seq)} sent); "
            "was the prompt truncated (--max-model-len below trainer.max_seq_len?)"
        )
    if len(rows) != len(seq) or rows[0] is not None:
        raise TeacherServerError(
            f"{where}: {len(rows)} prompt logprobs for {len(seq)} tokens (the first should be null)"
        )
    out = []
    for t, mask in enumerate(example.loss_mask):
        if not mask:
            out.append(0.0)
            continue
        entry = (rows[t + 1] or {}).get(str(seq[t + 1]))
        if entry is None:
            raise TeacherServerError(
                f"{where}: position {t + 1} has no logprob for its own token {seq[t + 1]}"
            )
        value = float(entry["logprob"])
        if value > 1e-4 or math.isnan(value):
            raise TeacherServerError(
                f"{where}: position {t + 1} answered {value}, not a logprob; the server was started with "
                "--logprobs-mode raw_logits or processed_logits: start it with the default (raw_logprobs)"
            )
        if value < LOWEST_LOGPROB:
            # -inf or -1e30 would make the teacher's KL term infinite or NaN: a broken or hostile server.
            raise TeacherServerError(
                f"{where}: position {t + 1} answered {value} for token {seq[t + 1]}, below any logprob a model "
                f"gives ({LOWEST_LOGPROB:g}); is distill.teacher a vLLM server of a model with this vocabulary?"
            )
        out.append(value)
    return out


def answer_choices(answer: Any, count: int, where: str) -> list[tuple[int, Mapping[str, Any]]]:
    """(prompt index, choice) for each of the `count` choices an answer must hold, or a TeacherServerError naming
    what is wrong with its shape."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != count:
        got = (
            f"{len(choices)} choices"
            if isinstance(choices, list)
            else f"no choices list ({str(answer)[:80]!r})"
        )
        raise TeacherServerError(f"{where}: {got} for {count} prompts")
    out = []
    for choice in choices:
        index = choice.get("index") if isinstance(choice, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise TeacherServerError(f"{where}: a choice with index {index!r}, not one of 0..{count - 1}")
        out.append((index, choice))
    return out


def served_model(models: Sequence[Mapping[str, Any]], wanted: str | None, url: str) -> str:
    """The model to ask for: distill.teacher_model, or the server's only one. A LoRA adapter (an entry with a
    parent) is refused: vLLM's GPU prompt logprobs ignore an lm_head LoRA (vLLM issue 51594)."""
    ids = [str(m.get("id")) for m in models]
    if wanted is None:
        bases = [m for m in models if not m.get("parent")]
        if len(models) != 1 and len(bases) != 1:
            raise ConfigError(
                f"distill.teacher={url!r} serves {len(ids)} models ({', '.join(ids) or 'none'}): set "
                "distill.teacher_model to the one to distil from"
            )
        wanted = str((models[0] if len(models) == 1 else bases[0])["id"])
    entry = next((m for m in models if m.get("id") == wanted), None)
    if entry is None:
        raise ConfigError(
            f"distill.teacher_model={wanted!r} is not served at {url} (it serves {', '.join(ids) or 'nothing'})"
        )
    if entry.get("parent"):
        raise ConfigError(
            f"distill.teacher_model={wanted!r} at {url} is a LoRA adapter on {entry['parent']!r}: vLLM's prompt "
            "logprobs on a GPU ignore an adapter's lm_head weights (vLLM issue 51594), so its scores could be the "
            "base's; serve the adapter merged into a model, or give its folder as distill.teacher (scored exactly "
            "in the trainer)"
        )
    return wanted


class TeacherServerError(RuntimeError):
    """The teacher server answered, but not what scoring needs."""


class UrlTeacher:
    """TeacherScoring (trainer/training/backend.py) by a vLLM server: sequences sent in requests of at most
    `batch_tokens` padded tokens, each request retried on transient failures for `retry_budget_s`."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        token: str | None = None,
        timeout_s: float = 300.0,
        batch_tokens: int = 65536,
        retry_budget_s: float = 300.0,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url = url
        self.root = server_root(url)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.root, timeout=timeout_s, headers=headers, transport=transport)
        self.timeout_s = timeout_s
        self.edge = RemoteComponent(
            "distillation teacher", url, "the teacher server's own log", retry_budget_s
        )
        self.batch_tokens = batch_tokens
        self.model = model if model is not None else self.resolve_model(None)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, what: str, body: dict[str, Any] | None = None) -> Any:
        response = self.edge.call(lambda: checked(self._bounded(method, path, what, body)), what)
        try:
            return response.json()
        except ValueError as exc:
            raise TeacherServerError(f"{self.url}, {what}: the answer is not JSON ({exc})") from exc

    def _bounded(self, method: str, path: str, what: str, body: dict[str, Any] | None) -> httpx.Response:
        """One attempt, read within timeout_s in all (httpx's timeout bounds each read, so a server that trickles
        a byte at a time could hold it forever) and MAX_ANSWER_BYTES in size."""
        deadline = time.monotonic() + self.timeout_s
        with self._http.stream(method, path, json=body) as streamed:
            chunks, size = [], 0
            for chunk in streamed.iter_bytes():
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    raise TeacherServerError(
                        f"{self.url}, {what}: the answer passed {MAX_ANSWER_BYTES} bytes; not a teacher's answer"
                    )
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout(
                        f"{self.url}, {what}: no whole answer within distill.teacher_timeout_s={self.timeout_s:g}s"
                    )
                chunks.append(chunk)
        return httpx.Response(
            streamed.status_code, headers=streamed.headers, content=b"".join(chunks), request=streamed.request
        )

    @classmethod
    def from_config(cls, cfg: RunConfig) -> UrlTeacher:
        """The run's URL teacher (distill.teacher and its teacher_* keys), retried within trainer.retry_budget_s."""
        d = cfg.distill
        assert d.teacher is not None
        return cls(
            d.teacher,
            d.teacher_model,
            d.api_key(),
            d.teacher_timeout_s,
            d.teacher_batch_tokens,
            cfg.trainer.retry_budget_s,
        )

    def models(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/models", "GET /v1/models")["data"])

    def resolve_model(self, wanted: str | None) -> str:
        return served_model(self.models(), wanted, self.url)

    def health(self) -> bool | None:
        """GET /health: True or False; None where the server has no such route (a proxy in front of it)."""
        try:
            status = self._http.get("/health").status_code
        except httpx.HTTPError:
            return False
        return None if status == 404 else status == 200

    def tokenize(self, text: str | None = None, messages: list[dict[str, str]] | None = None) -> list[int]:
        """The server's own tokenizer: raw text without special tokens, or a chat through its chat template."""
        body: dict[str, Any] = {"model": self.model}
        body.update(
            {"prompt": text, "add_special_tokens": False} if messages is None else {"messages": messages}
        )
        return list(self._call("POST", "/tokenize", "POST /tokenize", body)["tokens"])

    def teacher_logprobs(self, examples: Sequence[TrainingExample]) -> list[list[float]]:
        out: list[list[float]] = [[] for _ in examples]
        for plan in plan_micro_batches([len(e) + 1 for e in examples], self.batch_tokens):
            what = f"scoring {len(plan)} sequences ({sum(len(examples[i]) + 1 for i in plan)} tokens)"
            body = completion_request(self.model, [full_sequence(examples[i]) for i in plan])
            answer = self._call("POST", "/v1/completions", what, body)
            for index, choice in answer_choices(answer, len(plan), self.url):
                i = plan[index]  # choices are numbered in prompt order (n = 1)
                where = f"{self.url}, sequence {i}"
                try:
                    out[i] = target_logprobs(examples[i], choice, where)
                except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
                    raise TeacherServerError(
                        f"{where}: the answer's prompt_logprobs are malformed ({exc!r})"
                    ) from exc
        return out


def check_url_teacher(teacher: UrlTeacher, student_tokenizer: Any) -> list[str]:
    """Pre-flight: the teacher's tokenizer reads the student's token ids the same way (its ids for a few strings,
    and for a chat through its template, equal the student's). The reasons it is refused, or none."""
    problems = []
    for text in PROBE_TEXTS:
        theirs, ours = teacher.tokenize(text), list(student_tokenizer.encode(text, add_special_tokens=False))
        if theirs != ours:
            problems.append(
                f"distill.teacher={teacher.url!r} ({teacher.model}): its tokenizer differs from the student's "
                f"({text!r} is {theirs[:8]}... there, {ours[:8]}... here): the teacher scores the student's token "
                "ids, so both must share one tokenizer; serve a teacher of the student's model family"
            )
            return problems
    if getattr(student_tokenizer, "chat_template", None):
        ours = list(
            student_tokenizer.apply_chat_template(
                PROBE_CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        try:
            theirs = teacher.tokenize(messages=PROBE_CHAT)
        except httpx.HTTPStatusError as exc:
            theirs = [-1]
            if exc.response.status_code >= 500:
                raise
        if theirs != ours:
            problems.append(
                f"distill.teacher={teacher.url!r} ({teacher.model}): its chat template differs from the student's "
                "(a probe chat tokenizes differently there), so a prompt would read differently to it; serve the "
                "teacher with the student's template (vLLM's --chat-template)"
            )
    return problems


def preflight_url_teacher(distill: DistillConfig, student: str) -> list[str]:
    """Launch pre-flight of a URL teacher, within seconds: the server answers (/health where it has one, and
    /v1/models), serves one base model to ask for (written into distill.teacher_model, so the trainer asks for the
    same), and tokenizes as the student's tokenizer folder `student` does. The reasons it is refused, or none."""
    from transformers import AutoTokenizer

    assert distill.teacher is not None
    url = distill.teacher
    try:
        teacher = UrlTeacher(
            url, distill.teacher_model, distill.api_key(), timeout_s=30.0, retry_budget_s=10.0
        )
    except ConfigError as exc:
        return [str(exc)]
    except (httpx.HTTPError, ComponentDown, KeyError, ValueError) as exc:
        return [
            f"distill.teacher={url!r}: GET /v1/models did not answer a model list ({_reason(exc)}); start the "
            "teacher's vLLM server (vllm serve MODEL) or correct the URL"
            + (
                f" (a token is needed there: distill.teacher_api_key or ${TEACHER_API_KEY_ENV})"
                if _refused(exc)
                else ""
            )
        ]
    try:
        if teacher.health() is False:
            return [f"distill.teacher={url!r}: GET /health does not answer 200: the server is not ready"]
        distill.teacher_model = teacher.model
        return check_url_teacher(teacher, AutoTokenizer.from_pretrained(student))
    except (httpx.HTTPError, ComponentDown) as exc:
        return [f"distill.teacher={url!r}: POST /tokenize failed ({_reason(exc)}); a vLLM server answers it"]
    finally:
        teacher.close()


def _reason(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, ComponentDown) else describe(exc)


def _refused(exc: BaseException) -> bool:
    cause = exc.__cause__ if isinstance(exc, ComponentDown) else exc
    return isinstance(cause, httpx.HTTPStatusError) and cause.response.status_code in (401, 403)

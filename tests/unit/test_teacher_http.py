"""A distillation teacher behind a URL (trainer/training/teacher_http.py) against a fake vLLM server in-process
(httpx.MockTransport): the request it sends, how each answer maps back to the trained targets, batching, retries,
the errors a wrong server gets, model choice, pre-flight of the tokenizer, and the token kept out of print."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.helpers import make_cfg
from trainer.training.batch import TrainingExample
from trainer.training.config import TEACHER_API_KEY_ENV, ConfigError
from trainer.training.retries import ComponentDown
from trainer.training.teacher_http import (
    TeacherServerError,
    UrlTeacher,
    completion_request,
    preflight_url_teacher,
    served_model,
    server_root,
)

URL = "http://teacher.test:8000/v1"
BASE = {"id": "big-teacher", "object": "model", "root": "/models/big", "parent": None}


def fake_logprob(token: int, position: int) -> float:
    """What the fake teacher answers for `token` at `position` of a prompt: distinct per token and position."""
    return -((token % 7) + 1) / 10 - position / 1000


def vllm_choice(index: int, ids: list[int]) -> dict[str, Any]:
    rows: list[Any] = [None]  # vLLM's first prompt position has no context
    for t in range(1, len(ids)):  # JSON turns the token-id keys into strings, as vLLM's answers have them
        rows.append({str(ids[t]): {"logprob": fake_logprob(ids[t], t), "rank": 1, "decoded_token": "x"}})
    return {
        "index": index,
        "text": "",
        "prompt_logprobs": rows,
        "prompt_token_ids": ids,
        "finish_reason": "length",
    }


class FakeServer:
    """/v1/models, /health, /tokenize and /v1/completions as vLLM answers them, with hooks to break each."""

    def __init__(
        self, models: list[dict[str, Any]] | None = None, tokenize: Callable[[dict], list[int]] | None = None
    ):
        self.models = models if models is not None else [BASE]
        self.tokenize = tokenize or (lambda body: [])
        self.requests: list[httpx.Request] = []
        self.bodies: list[dict[str, Any]] = []
        self.fail_next: list[int] = []  # statuses to answer first, one per request
        self.edit_choice: Callable[[dict[str, Any]], dict[str, Any]] = lambda c: c
        self.reverse = False  # answer the choices in reverse order (their `index` still says which)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.fail_next:
            return httpx.Response(self.fail_next.pop(0), text="busy")
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": self.models})
        if path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        self.bodies.append(body)
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": self.tokenize(body), "count": 0, "max_model_len": 64})
        if path == "/v1/completions":
            choices = [self.edit_choice(vllm_choice(i, ids)) for i, ids in enumerate(body["prompt"])]
            answer = {"choices": choices[::-1] if self.reverse else choices}
            # As Python servers write it: -inf and NaN as the non-standard -Infinity and NaN.
            return httpx.Response(
                200, content=json.dumps(answer).encode(), headers={"content-type": "application/json"}
            )
        return httpx.Response(404, json={"detail": "Not Found"})


def teacher(server: FakeServer, **kwargs: Any) -> UrlTeacher:
    return UrlTeacher(URL, transport=httpx.MockTransport(server), **kwargs)


def example(seq: list[int], trained_from: int) -> TrainingExample:
    n = len(seq) - 1
    mask = [1.0 if t >= trained_from else 0.0 for t in range(n)]
    return TrainingExample(seq[:-1], seq[1:], mask, [-1.0] * n, [0.0] * n)


EXAMPLES = [
    example([5, 9, 11, 12, 40, 3], 2),
    example([7, 8, 100, 2], 1),
    example([1, 2, 3, 4, 5, 6, 7, 8, 9], 4),
]


def expected(ex: TrainingExample) -> list[float]:
    """Target t is token t + 1, scored at prompt position t + 1; untrained targets are 0.0."""
    return [
        fake_logprob(tok, t + 1) if m else 0.0 for t, (tok, m) in enumerate(zip(ex.target_ids, ex.loss_mask))
    ]


def test_the_request_scores_the_whole_sequences_without_generating():
    body = completion_request("m", [[1, 2, 3], [4, 5]])
    assert body["prompt"] == [[1, 2, 3], [4, 5]] and body["model"] == "m"
    assert body["echo"] is True and body["max_tokens"] == 0 and body["prompt_logprobs"] == 0
    assert body["return_token_ids"] is True
    assert server_root(URL) == server_root("http://teacher.test:8000/") == "http://teacher.test:8000"
    assert server_root("https://h/teacher/v1/") == "https://h/teacher"  # a proxy's path prefix is kept


@pytest.mark.parametrize("batch_tokens", [65536, 12])
def test_each_target_gets_the_teacher_logprob_of_its_token_in_batches_of_the_budget(batch_tokens):
    server = FakeServer()
    server.reverse = True
    got = teacher(server, batch_tokens=batch_tokens).teacher_logprobs(EXAMPLES)
    assert got == [pytest.approx(expected(ex), abs=0) for ex in EXAMPLES]
    sent = [ids for body in server.bodies for ids in body["prompt"]]
    assert sorted(sent) == sorted([*ex.input_ids, ex.target_ids[-1]] for ex in EXAMPLES)
    for body in server.bodies:  # count x longest within the budget, unless a sequence is alone
        widths = [len(ids) for ids in body["prompt"]]
        assert len(widths) == 1 or len(widths) * max(widths) <= batch_tokens
    assert len(server.bodies) == (1 if batch_tokens == 65536 else 2)  # 9 alone, then 6 + 4 as 2 x 6
    assert all(body["model"] == "big-teacher" for body in server.bodies)  # the only model, asked for by name


def test_a_server_that_is_not_what_scoring_needs_is_named_with_the_reason():
    cases: list[tuple[Callable[[dict[str, Any]], dict[str, Any]], str]] = [
        (lambda c: {**c, "prompt_logprobs": None}, "has no prompt_logprobs"),
        (lambda c: {**c, "prompt_token_ids": c["prompt_token_ids"][:-1]}, "scored other tokens than sent"),
        (lambda c: {**c, "prompt_logprobs": c["prompt_logprobs"][:-1]}, "prompt logprobs for"),
        (
            lambda c: {
                **c,
                "prompt_logprobs": [None] + [{"0": {"logprob": -1.0}} for _ in c["prompt_logprobs"][1:]],
            },
            "has no logprob for its own token",
        ),
        (
            lambda c: {
                **c,
                "prompt_logprobs": [None]
                + [{k: {"logprob": 3.5} for k in r} for r in c["prompt_logprobs"][1:]],
            },
            "--logprobs-mode raw_logits",
        ),
    ]
    for edit, message in cases:
        server = FakeServer()
        server.edit_choice = edit
        with pytest.raises(TeacherServerError, match=message):
            teacher(server).teacher_logprobs(EXAMPLES)
    broken = TrainingExample([1, 2, 3], [9, 9, 9], [1.0] * 3, [0.0] * 3, [0.0] * 3)
    with pytest.raises(ValueError, match="not its inputs shifted by one"):
        teacher(FakeServer()).teacher_logprobs([broken])


def every_logprob(value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda c: {
        **c,
        "prompt_logprobs": [None] + [{k: {"logprob": value} for k in r} for r in c["prompt_logprobs"][1:]],
    }


@pytest.mark.parametrize(
    "edit,message",
    [
        (every_logprob(-1e30), "below any logprob"),
        (every_logprob(float("-inf")), "below any logprob"),
        (every_logprob("x"), "malformed"),
        (every_logprob(None), "malformed"),
        (
            lambda c: {**c, "prompt_logprobs": [None] + [[1, 2]] * (len(c["prompt_logprobs"]) - 1)},
            "malformed",
        ),
        (lambda c: {**c, "index": 7}, "index 7"),
        (lambda c: {**c, "index": "0"}, "index '0'"),
        (lambda c: [1, 2], "index None"),
    ],
)
def test_a_hostile_or_broken_answer_is_a_named_teacher_error(edit, message):
    """A logprob of -1e30 made the teacher's KL 1e30, -inf passed as a missing sampler logprob (NaN, no error);
    garbage shapes raised bare KeyError/IndexError instead of naming the teacher."""
    server = FakeServer()
    server.edit_choice = edit
    with pytest.raises(TeacherServerError, match=message):
        teacher(server).teacher_logprobs(EXAMPLES)


def test_an_answer_that_is_not_json_or_lacks_choices_is_named():
    for answer, message in (
        (b"<html>", "not JSON"),
        (b'{"choices": 3}', "no choices list"),
        (b"[]", "no choices"),
    ):
        server = FakeServer()

        def reply(
            request: httpx.Request, answer: bytes = answer, server: FakeServer = server
        ) -> httpx.Response:
            if request.url.path == "/v1/completions":
                return httpx.Response(200, content=answer)
            return server(request)

        t = UrlTeacher(URL, transport=httpx.MockTransport(reply))
        with pytest.raises(TeacherServerError, match=message):
            t.teacher_logprobs(EXAMPLES)


def test_a_trickling_or_endless_answer_is_cut_at_the_deadline_or_the_size_bound(monkeypatch):
    """httpx's timeout bounds each read: a server sending a byte now and then held teacher_timeout_s=3 for 22 s,
    and a 1.5 GB answer ran the trainer out of memory."""
    import time

    from trainer.training import teacher_http

    class Trickle(httpx.SyncByteStream):
        def __iter__(self):  # type: ignore[override]
            while True:
                time.sleep(0.05)
                yield b" "

    server = FakeServer()

    def reply(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            return httpx.Response(200, stream=Trickle())
        return server(request)

    t = UrlTeacher(URL, transport=httpx.MockTransport(reply), timeout_s=0.5, retry_budget_s=1.0)
    started = time.monotonic()
    with pytest.raises(Exception, match=r"teacher_timeout_s=0\.5|distillation teacher"):
        t.teacher_logprobs(EXAMPLES)
    assert time.monotonic() - started < 5
    monkeypatch.setattr(teacher_http, "MAX_ANSWER_BYTES", 1000)

    class Flood(httpx.SyncByteStream):
        def __iter__(self):  # type: ignore[override]
            while True:
                yield b"x" * 512

    def flood(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            return httpx.Response(200, stream=Flood())
        return server(request)

    with pytest.raises(TeacherServerError, match="passed 1000 bytes"):
        UrlTeacher(URL, transport=httpx.MockTransport(flood)).teacher_logprobs(EXAMPLES)


def test_transient_failures_are_retried_and_a_lasting_one_names_the_teacher():
    server = FakeServer()
    t = teacher(server, retry_budget_s=30)
    server.fail_next = [503, 502]
    assert t.teacher_logprobs(EXAMPLES[:1]) == [pytest.approx(expected(EXAMPLES[0]), abs=0)]
    server.fail_next = [400]  # the caller's mistake: at once, not retried
    with pytest.raises(httpx.HTTPStatusError, match="400"):
        t.teacher_logprobs(EXAMPLES[:1])
    down = teacher(server, retry_budget_s=1)
    server.fail_next = [503] * 1000
    with pytest.raises(
        ComponentDown, match=r"distillation teacher at http://teacher.test:8000/v1: scoring 1 seq"
    ):
        down.teacher_logprobs(EXAMPLES[:1])


def test_the_token_goes_in_the_header_and_never_into_a_print(monkeypatch):
    from trainer.orchestration.launcher import describe_teacher, redacted, redacted_override

    server = FakeServer()
    teacher(server, token="s3cret").teacher_logprobs(EXAMPLES[:1])
    assert {r.headers.get("authorization") for r in server.requests} == {"Bearer s3cret"}
    cfg = make_cfg("/tmp/unused", distill__teacher=URL, distill__teacher_api_key="s3cret")
    shown = json.dumps(redacted(cfg.model_dump(mode="json"))) + describe_teacher(cfg)
    assert "s3cret" not in shown and URL in shown and "with a token" in shown
    assert redacted_override("distill.teacher_api_key=s3cret") == "distill.teacher_api_key=<hidden>"
    monkeypatch.setenv(TEACHER_API_KEY_ENV, "from-env")
    cfg = make_cfg("/tmp/unused", distill__teacher=URL, distill__teacher_model="big-teacher")
    assert "big-teacher, with a token" in describe_teacher(cfg)


def test_the_model_is_the_named_one_or_the_only_base_and_a_lora_is_refused():
    lora = {"id": "policy-v3", "root": "/adapters/v3", "parent": "big-teacher"}
    other = {"id": "small", "root": "/models/small", "parent": None}
    assert served_model([BASE], None, URL) == "big-teacher"
    assert served_model([BASE, lora], None, URL) == "big-teacher"  # a base and its adapters: the base
    assert served_model([BASE, other], "small", URL) == "small"
    with pytest.raises(
        ConfigError, match=r"serves 2 models \(big-teacher, small\): set distill.teacher_model"
    ):
        served_model([BASE, other], None, URL)
    with pytest.raises(ConfigError, match=r"'nope' is not served .* \(it serves big-teacher\)"):
        served_model([BASE], "nope", URL)
    with pytest.raises(ConfigError, match=r"is a LoRA adapter on 'big-teacher'.*vLLM issue 51594"):
        served_model([BASE, lora], "policy-v3", URL)


def test_url_keys_belong_to_a_url_teacher_and_it_resolves_to_itself():
    from trainer.training.distill import resolve_teacher, teacher_kind

    cfg = make_cfg("/tmp/unused", distill__teacher=URL)
    assert cfg.distill.by_url and resolve_teacher(URL) == URL and teacher_kind(URL) == "url"
    with pytest.raises(Exception, match="apply to a teacher behind a URL"):
        make_cfg("/tmp/unused", distill__teacher="tiny", distill__teacher_model="m")


@pytest.fixture(scope="module")
def student_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_preflight_accepts_the_students_tokenizer_and_refuses_another(
    monkeypatch, tiny_model_path, student_tokenizer
):
    import trainer.training.teacher_http as th

    def same(body: dict) -> list[int]:
        if "messages" in body:
            return list(
                student_tokenizer.apply_chat_template(
                    body["messages"], add_generation_prompt=True, return_dict=False
                )
            )
        return list(student_tokenizer.encode(body["prompt"], add_special_tokens=False))

    real = th.UrlTeacher.__init__

    def serve(server: FakeServer) -> None:

        def init(self: UrlTeacher, *args: Any, **kwargs: Any) -> None:
            real(self, *args, **{**kwargs, "transport": httpx.MockTransport(server)})

        monkeypatch.setattr(th.UrlTeacher, "__init__", init)

    cfg = make_cfg("/tmp/unused", distill__teacher=URL)
    serve(FakeServer(tokenize=same))
    assert preflight_url_teacher(cfg.distill, str(tiny_model_path)) == []
    assert cfg.distill.teacher_model == "big-teacher"  # fixed for the trainer
    serve(FakeServer(tokenize=lambda body: [i + 1 for i in same(body)]))
    (problem,) = preflight_url_teacher(cfg.distill, str(tiny_model_path))
    assert "its tokenizer differs from the student's" in problem
    assert student_tokenizer.chat_template  # so the chat probe runs
    serve(FakeServer(tokenize=lambda body: same(body)[:-1] if "messages" in body else same(body)))
    (problem,) = preflight_url_teacher(cfg.distill, str(tiny_model_path))
    assert "its chat template differs" in problem
    serve(FakeServer(models=[BASE, {**BASE, "id": "other"}]))
    cfg = make_cfg("/tmp/unused", distill__teacher=URL)
    (problem,) = preflight_url_teacher(cfg.distill, str(tiny_model_path))
    assert "set distill.teacher_model" in problem
    refusing = FakeServer()
    refusing.fail_next = [401]
    serve(refusing)
    (problem,) = preflight_url_teacher(cfg.distill, str(tiny_model_path))
    assert "HTTP 401" in problem and TEACHER_API_KEY_ENV in problem


def test_the_trainer_scores_a_url_teacher_through_the_server_beside_its_own_backend(tmp_path):
    from trainer.backends.build import build_backend
    from trainer.backends.local import LocalBackend
    from trainer.training.backend import TeacherScoring

    cfg = make_cfg(tmp_path, distill__teacher=URL, distill__teacher_model="big-teacher")
    backend = build_backend(cfg)  # no request yet: the model is named
    assert isinstance(backend, LocalBackend) and isinstance(backend, TeacherScoring)
    assert backend.teacher_model is None and backend.url_teacher is not None  # no teacher weights here
    assert (backend.url_teacher.url, backend.url_teacher.model) == (URL, "big-teacher")
    server = FakeServer()
    backend.url_teacher = teacher(server, model="big-teacher")
    assert backend.teacher_logprobs(EXAMPLES) == [pytest.approx(expected(ex), abs=0) for ex in EXAMPLES]
    assert not math.isnan(backend.teacher_logprobs(EXAMPLES)[0][2])

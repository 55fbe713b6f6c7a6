"""inference/samplers/scoring_split.py: a scoring request for several sequences becomes single-sequence requests
whose merged answer is shaped as vLLM's own, and nothing else is split."""

from __future__ import annotations

from inference.samplers.scoring_split import merge_answers, split_scoring_body


def test_only_scoring_requests_for_several_sequences_are_split():
    assert split_scoring_body("/v1/completions", {"prompt": [1, 2], "n": 4}) is None  # no prompt scores
    assert (
        split_scoring_body("/v1/completions", {"prompt": [1, 2], "prompt_logprobs": 0}) is None
    )  # one sequence
    assert split_scoring_body("/v1/completions", {"prompt": "hi", "echo": True, "n": 1}) is None
    assert split_scoring_body("/v1/load_lora_adapter", {"prompt_logprobs": 0, "n": 3}) is None


def test_n_samples_of_several_prompts_become_one_request_each_in_vllms_choice_order():
    body = {"prompt": [[5, 6], [7, 8, 9]], "n": 2, "prompt_logprobs": 0, "max_tokens": 2, "seed": 10}
    parts = split_scoring_body("/v1/completions", body)
    assert parts is not None
    assert [(sub["prompt"], sub["n"], sub["seed"], index, prompt) for sub, index, prompt in parts] == [
        ([5, 6], 1, 10, 0, 0),
        ([5, 6], 1, 11, 1, 0),
        ([7, 8, 9], 1, 10, 2, 1),
        ([7, 8, 9], 1, 11, 3, 1),
    ]
    assert all(sub["prompt_logprobs"] == 0 and sub["max_tokens"] == 2 for sub, _, _ in parts)
    answers = [
        {
            "id": f"c{i}",
            "choices": [{"index": 0, "text": f"t{i}", "prompt_logprobs": [None, {str(i): -1.0}]}],
            "usage": {"prompt_tokens": 2 if i < 2 else 3, "completion_tokens": 2, "total_tokens": 0},
        }
        for i in range(4)
    ]
    merged = merge_answers(answers, parts)
    assert [c["index"] for c in merged["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in merged["choices"]] == ["t0", "t1", "t2", "t3"]
    assert merged["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    assert merged["id"] == "c0"


def test_a_text_prompt_and_a_chat_request_with_n_split_by_sample():
    parts = split_scoring_body("/v1/completions", {"prompt": "one text", "echo": True, "logprobs": 1, "n": 3})
    assert parts is not None and [sub["prompt"] for sub, _, _ in parts] == ["one text"] * 3
    assert "seed" not in parts[0][0]  # no seed asked: none invented
    chat = {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "n": 2}
    parts = split_scoring_body("/v1/chat/completions", chat)
    assert parts is not None and [(s["n"], i) for s, i, _ in parts] == [(1, 0), (1, 1)]
    assert all(s["messages"] == chat["messages"] for s, _, _ in parts)

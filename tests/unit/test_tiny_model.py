"""The offline tiny model: Llama shape vLLM's CPU attention accepts, a working tokenizer and chat template,
deterministic build."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from trainer.backends.tiny_model import VOCAB_SIZE, build_tiny_model


def test_shape_and_tokenizer(tiny_model_path):
    cfg = AutoConfig.from_pretrained(tiny_model_path)
    assert cfg.model_type == "llama" and cfg.head_dim >= 32 and cfg.head_dim in (32, 64, 80, 96, 112, 128)
    assert cfg.vocab_size == VOCAB_SIZE and cfg.tie_word_embeddings is False
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    assert len(tok) == VOCAB_SIZE
    text = "Ann has 12 apples and gets 30 more. 12 + 30 = 42"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and len(ids) < len(text) / 2  # BPE merged words, not bytes
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|eos|>" and tok.convert_tokens_to_ids("<|im_end|>") in cfg.eos_token_id


def test_model_runs_and_is_random(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    logits = model(torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, VOCAB_SIZE) and torch.isfinite(logits).all()
    assert logits.std() > 0


def test_build_is_deterministic(tmp_path):
    a, b = build_tiny_model(tmp_path / "a", seed=3), build_tiny_model(tmp_path / "b", seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert json.loads((a / "tokenizer.json").read_text()) == json.loads((b / "tokenizer.json").read_text())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

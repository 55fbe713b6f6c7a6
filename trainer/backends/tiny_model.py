"""An offline stand-in for real weights: a randomly initialised Llama (or, as `tiny-moe`, a Qwen3-MoE with a few
experts) with a byte-level BPE tokenizer trained on text generated here, and a chat template. Built with no network, deterministic for a given seed, cached on disk.

head_dim is 32 because vLLM's CPU attention rejects 16; tie_word_embeddings is off so lm_head can carry LoRA.
Must not import vLLM or anything that downloads.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

BUILDER_VERSION = 2  # bump when the recipe changes so cached copies are rebuilt
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
}

# The mixture-of-experts variant: a Qwen3-MoE with MODEL_SHAPE's attention and these experts in every layer.
MOE_SHAPE: dict[str, Any] = {
    "moe_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}
TINY_NAMES = {"tiny": False, "tiny-moe": True}  # model.path -> built as the MoE variant

_WORDS = (
    "the a of to and in is it that was for on are with as his they be at one have this from or had by word but "
    "what some we can out other were all there when up use your how said an each she which do their time if will "
    "way about many then them write would like so these her long make thing see him two has look more day could go "
    "come did number sound no most people my over know water than call first who may down side been now find any "
    "new work part take get place made live where after back little only round man year came show every good me "
    "give our under name very through just form sentence great think say help low line differ turn cause much mean "
    "before move right boy old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went light kind off need "
    "house picture try us again animal point mother world near build self earth father apples pens books coins "
    "marbles dollars cookies eggs miles hours minutes total left gives buys sells spends each more less twice half"
).split()


def generate_corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    """Word-problem-like English with numbers and chat markup, so BPE learns words, digits and operators."""
    rng = random.Random(seed)
    names = ["Ann", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo"]
    out = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.4:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice(["+", "-", "*", "/"])
            out.append(
                f"{rng.choice(names)} has {a} {rng.choice(_WORDS)} and gets {b} more. {a} {op} {b} = ?"
            )
        elif kind < 0.8:
            out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 20))).capitalize() + ".")
        else:
            q = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 10)))
            out.append(
                f"<|im_start|>user\n{q}?<|im_end|>\n<|im_start|>assistant\n#### {rng.randint(0, 9999)}<|im_end|>"
            )
    return out


def build_tokenizer(seed: int = 0):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | Path, seed: int = 0, moe: bool = False) -> Path:
    """Write a random Llama (with `moe`, a Qwen3-MoE: MOE_SHAPE's experts in every layer) + tokenizer to out_dir
    (atomically: a temp folder renamed into place)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out_dir)
    tokenizer = build_tokenizer(seed)
    common = {
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")],
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": "float32",
        **MODEL_SHAPE,
    }
    torch.manual_seed(seed)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, **MOE_SHAPE)).float()
    else:
        model = LlamaForCausalLM(LlamaConfig(**common)).float()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "tiny_model.json").write_text(json.dumps({"builder_version": BUILDER_VERSION, "seed": seed}))
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "tiny_model.json").exists():  # lost a race to another builder: theirs is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_cache_dir() -> Path:
    root = os.environ.get("TINY_MODEL_CACHE") or Path(__file__).resolve().parents[2] / ".cache"
    return Path(root)


def ensure_tiny_model(seed: int = 0, cache_dir: str | Path | None = None, moe: bool = False) -> Path:
    """Path of the cached tiny model for this seed, building it on first use (a few seconds)."""
    base = Path(cache_dir) if cache_dir else default_cache_dir()
    path = base / f"tiny-{'qwen3moe' if moe else 'llama'}-v{BUILDER_VERSION}-seed{seed}"
    if not (path / "tiny_model.json").exists():
        build_tiny_model(path, seed, moe)
    return path


def tiny_model_named(path: str) -> Path | None:
    """The built-in test model a model.path names ('tiny': the Llama, 'tiny-moe': the Qwen3-MoE), or None."""
    if path not in TINY_NAMES:
        return None
    return ensure_tiny_model(moe=TINY_NAMES[path])

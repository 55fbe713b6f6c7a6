"""A batch of training examples cut into micro-batches, each with the model inputs of its layout: `packed` (the
default: no padding, a shared prefix computed once; trainer.training.packing) or `padded` (every sequence
right-padded to the longest in its micro-batch; the reference the tests compare the packed path against)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.backends.packed_forward import layout_tensors, packed_hidden_states
from trainer.training.batch import TrainingExample, examples_to_tensors, plan_micro_batches
from trainer.training.logprobs import compute_row_logprobs, compute_token_logprobs
from trainer.training.packing import build_layout, plan_packed_micro_batches


@dataclass
class MicroBatch:
    indices: list[int]  # into the caller's examples: row b of every [B, T] tensor is examples[indices[b]]
    model_inputs: dict[str, torch.Tensor]  # what causal_lm_logprobs takes
    real_tokens: int  # the input tokens of its sequences
    computed_tokens: int  # the tokens the forward computes (padding and repeated prefixes included)


def plan(
    examples: Sequence[TrainingExample],
    indices: Sequence[int],
    token_budget: int,
    layout: str,
    min_shared_prefix: int,
    device: torch.device,
) -> list[MicroBatch]:
    """The micro-batches of examples[i] for i in indices."""
    real = [len(examples[i]) for i in indices]
    if layout == "padded":
        out = []
        for piece in plan_micro_batches(real, token_budget):
            chunk = [examples[indices[j]] for j in piece]
            tensors = examples_to_tensors(chunk)
            inputs = {k: tensors[k].to(device) for k in ("input_ids_BT", "attention_mask_BT")}
            width = inputs["input_ids_BT"].shape[1]
            out.append(
                MicroBatch(
                    [indices[j] for j in piece], inputs, sum(real[j] for j in piece), width * len(piece)
                )
            )
        return out
    sequences = [examples[i].input_ids for i in indices]
    out = []
    for trees in plan_packed_micro_batches(sequences, token_budget, min_shared_prefix):
        layout_ = build_layout(sequences, trees)
        inputs = layout_tensors(layout_, device)
        width = max(len(r) for r in layout_.rows)
        rows_BT = torch.zeros((len(layout_.rows), width), dtype=torch.long)
        for b, rows in enumerate(layout_.rows):
            rows_BT[b, : len(rows)] = torch.tensor(rows)
        inputs["rows_BT"] = rows_BT.to(device)
        members = [indices[j] for j in layout_.members]
        out.append(
            MicroBatch(members, inputs, sum(real[j] for j in layout_.members), layout_.computed_tokens)
        )
    return out


def causal_lm_logprobs(
    causal_lm: Any,
    model_inputs: dict[str, torch.Tensor],
    target_ids_BT: torch.Tensor,
    select_BT: torch.Tensor,
    temperature_B: torch.Tensor | None,
    chunk_tokens: int,
) -> torch.Tensor:
    """Token logprobs [B, T] (or [B, T, K]) of a micro-batch under a transformers causal LM (the student's base with
    its active adapter, or a teacher model): the decoder's hidden states, then the head in chunks (never the whole
    [B, T, V] logits). Packed inputs need the packed attention enabled on the model."""
    head = causal_lm.get_output_embeddings()
    if "tokens_1N" in model_inputs:
        hidden_NH = packed_hidden_states(causal_lm, model_inputs)
        return compute_row_logprobs(
            head, hidden_NH, model_inputs["rows_BT"], target_ids_BT, select_BT, temperature_B, chunk_tokens
        )
    hidden_BTH = causal_lm.get_decoder()(
        input_ids=model_inputs["input_ids_BT"],
        attention_mask=model_inputs["attention_mask_BT"],
        use_cache=False,
    ).last_hidden_state
    return compute_token_logprobs(head, hidden_BTH, target_ids_BT, select_BT, temperature_B, chunk_tokens)

"""Per-token log-probabilities of target tokens from hidden states, one lm_head chunk at a time.

Full-vocabulary fp32 logits exist for at most `chunk_tokens` positions at once, in forward and in backward
(each chunk is recomputed under activation checkpointing), so memory is O(chunk x vocab), not O(B x T x vocab).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden_NH: torch.Tensor,
    targets_NK: torch.Tensor,
    inv_temperature_N: torch.Tensor,
) -> torch.Tensor:
    """[N, K] logprobs of the [N, K] token ids in targets_NK."""
    logits_NV = head(hidden_NH).float() * inv_temperature_N[:, None]
    # logsumexp + gather instead of log_softmax: never materialises a second [N, V] tensor.
    picked_NK = logits_NV.gather(1, targets_NK)
    return picked_NK - torch.logsumexp(logits_NV, dim=-1, keepdim=True)


def compute_token_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden_BTH: torch.Tensor,
    target_ids_BT: torch.Tensor,
    select_BT: torch.Tensor,
    temperature_B: torch.Tensor | None = None,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """log p(target_t | prefix) at positions where select_BT is true; 0 elsewhere. Returns fp32 [B, T], or
    [B, T, K] for [B, T, K] targets (K candidate tokens per position, scored from one logits row).

    `head` maps hidden states to logits (the model's lm_head, LoRA included). Logits are divided by the
    per-sequence temperature when given (sampler reports post-temperature logprobs).
    """
    B, T, H = hidden_BTH.shape
    rows_BT = torch.arange(B * T, device=hidden_BTH.device).reshape(B, T)
    return compute_row_logprobs(
        head, hidden_BTH.reshape(B * T, H), rows_BT, target_ids_BT, select_BT, temperature_B, chunk_tokens
    )


def compute_row_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden_RH: torch.Tensor,
    rows_BT: torch.Tensor,
    target_ids_BT: torch.Tensor,
    select_BT: torch.Tensor,
    temperature_B: torch.Tensor | None = None,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """compute_token_logprobs for hidden states stored as rows: position (b, t) is row rows_BT[b, t] of hidden_RH
    (a packed micro-batch, where a shared prefix's rows serve every sequence of its group)."""
    B, T = rows_BT.shape
    flat_select = select_BT.reshape(-1).nonzero().squeeze(1)
    hidden_NH = hidden_RH.index_select(0, rows_BT.reshape(-1).index_select(0, flat_select))
    targets_NK = target_ids_BT.reshape(B * T, -1).index_select(0, flat_select)
    K = targets_NK.shape[1]
    if temperature_B is None:
        inv_t_N = torch.ones(len(flat_select), device=hidden_RH.device, dtype=torch.float32)
    else:
        inv_t_N = (
            (1.0 / temperature_B.float())
            .to(hidden_RH.device)
            .repeat_interleave(T)
            .index_select(0, flat_select)
        )
    pieces = []
    for start in range(0, len(flat_select), chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        args = (hidden_NH[sl], targets_NK[sl], inv_t_N[sl])
        if torch.is_grad_enabled() and hidden_NH.requires_grad:
            pieces.append(checkpoint(_chunk_logprobs, head, *args, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(head, *args))
    out_N = torch.cat(pieces) if pieces else hidden_RH.new_zeros((0, K), dtype=torch.float32)
    out_BT = torch.zeros((B * T, K), device=hidden_RH.device, dtype=torch.float32)
    return out_BT.index_copy(0, flat_select, out_N).reshape(target_ids_BT.shape)


def top_logprobs(logprobs_PV: torch.Tensor, k: int) -> list[dict[int, float]]:
    """Per row, the k largest logprobs as token id -> logprob (the shape vLLM's top-k answers take)."""
    top = logprobs_PV.topk(min(k, logprobs_PV.shape[-1]), dim=-1)
    return [
        dict(zip(ids.tolist(), lps.tolist(), strict=True))
        for ids, lps in zip(top.indices, top.values, strict=True)
    ]

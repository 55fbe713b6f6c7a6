"""The packed forward: a micro-batch as one row of tokens (trainer.training.packing) through a transformers causal
LM, with an attention that keeps each sequence to its own tokens and lets a group's members read their shared
prefix's keys and values instead of computing the prefix again.

The attention is registered with transformers' AttentionInterface under its own name and switched on per model
(`enable_packed_attention`). A call that carries the packed segments (keyword `rl_packed`) gathers each segment's
queries, its context's and its own keys/values into padded batches of similar size (`packing.bucket_segments`),
runs scaled-dot-product attention on them with an exact mask, and scatters the outputs back to the packed row. Any
other call (generation, the publish probe, a padded teacher batch) goes to the model's own implementation with its
own mask, unchanged. Exact on every device: torch's SDPA with a full mask, no approximate kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from trainer.training.packing import PackedLayout, Segment, bucket_segments

PACKED = "rl_packed"  # the attention implementation's name prefix in transformers' registry
_FALLBACK_OF: dict[str, str] = {}  # registered name -> the implementation it stands in for


def enable_packed_attention(model: Any) -> None:
    """Switch `model` (a transformers PreTrainedModel) to the packed attention, which forwards every call without
    packed segments to the implementation the model had (sdpa or a flash kernel; eager runs as sdpa)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    current = model.config._attn_implementation or "sdpa"
    if current.startswith(PACKED):
        return
    base = current if current in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping else "sdpa"
    name = f"{PACKED}_{base}"
    _FALLBACK_OF[name] = base
    AttentionInterface.register(name, _packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)


class PackedSegments:
    """The segments of one layout as index tensors, one padded batch per bucket, on the model's device."""

    def __init__(self, layout: dict[str, torch.Tensor], dtype: torch.dtype):
        # An additive mask in the model's dtype, made once: SDPA would otherwise convert the bool mask in every
        # layer and keep each copy for the backward.
        self.buckets = [
            (
                layout[f"q_rows_{b}"],
                layout[f"k_rows_{b}"],
                torch.zeros(
                    layout[f"mask_{b}"].shape, dtype=dtype, device=layout[f"mask_{b}"].device
                ).masked_fill(~layout[f"mask_{b}"], float("-inf")),
            )
            for b in range(int(layout["buckets"].item()))
        ]
        self.inverse = layout[
            "inverse_N"
        ]  # packed row n's output is row inverse[n] of the buckets' flat outputs


def layout_tensors(layout: PackedLayout, device: torch.device) -> dict[str, torch.Tensor]:
    """Everything the packed forward needs as tensors (a dict, which DDP moves and passes through as it is)."""
    n = layout.computed_tokens
    out: dict[str, torch.Tensor] = {
        "tokens_1N": torch.tensor([layout.tokens], dtype=torch.long),
        "positions_1N": torch.tensor([layout.positions], dtype=torch.long),
    }
    inverse = torch.full((n,), -1, dtype=torch.long)
    offset = 0
    groups = bucket_segments(layout.segments)
    for b, group in enumerate(groups):
        q_rows, k_rows, mask = _bucket_tensors([layout.segments[s] for s in group], pad_row=n)
        S, L = q_rows.shape
        flat = torch.arange(S * L).reshape(S, L)
        valid = q_rows < n
        inverse[q_rows[valid]] = flat[valid] + offset
        offset += S * L
        out.update({f"q_rows_{b}": q_rows, f"k_rows_{b}": k_rows, f"mask_{b}": mask})
    if n and bool((inverse < 0).any()):
        raise AssertionError("packed layout: a token belongs to no segment")
    out["inverse_N"] = inverse
    out["buckets"] = torch.tensor(len(groups))
    return {k: v.to(device) for k, v in out.items()}


def _bucket_tensors(segments: list[Segment], pad_row: int) -> tuple[torch.Tensor, ...]:
    """[S, L] query rows, [S, K] key rows (context, then own), [S, 1, L, K] mask (True: attend). Padding rows
    point at pad_row (a zero row appended to q/k/v) and attend to key 0 only, so no softmax row is empty."""
    L = max(s.own_len for s in segments)
    K = max(s.context_len + s.own_len for s in segments)
    S = len(segments)
    q_rows = torch.full((S, L), pad_row, dtype=torch.long)
    k_rows = torch.full((S, K), pad_row, dtype=torch.long)
    ctx = torch.tensor([s.context_len for s in segments])
    own = torch.tensor([s.own_len for s in segments])
    for i, s in enumerate(segments):
        q_rows[i, : s.own_len] = torch.arange(*s.rows)
        k_rows[i, : s.context_len] = torch.arange(*s.context)
        k_rows[i, s.context_len : s.context_len + s.own_len] = torch.arange(*s.rows)
    j = torch.arange(L)[None, :, None]  # query position within its segment
    k = torch.arange(K)[None, None, :]
    c, o = ctx[:, None, None], own[:, None, None]
    own_key = k - c  # a key's position within the segment's own rows
    mask = (k < c) | ((own_key >= 0) & (own_key <= j))
    mask = (mask & (j < o)) | ((j >= o) & (k == 0))
    return q_rows, k_rows, mask[:, None]


def _packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    rl_packed: PackedSegments | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if rl_packed is None:
        from transformers import AttentionInterface

        base = _FALLBACK_OF[module.config._attn_implementation]
        fallback = AttentionInterface._global_mapping[base]
        return fallback(  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    # query [1, Hq, N, d]; key, value [1, Hkv, N, d]: one packed row. A zero row at N stands for padding.
    heads, kv_heads = query.shape[1], key.shape[1]
    q, k, v = (F.pad(x[0], (0, 0, 0, 1)) for x in (query, key, value))
    outputs = []
    for q_rows, k_rows, mask in rl_packed.buckets:
        # index_select, not advanced indexing: its backward is an index_add, several times faster on CPU.
        def gather(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            return x.index_select(1, rows.reshape(-1)).unflatten(1, rows.shape).transpose(0, 1)

        out = F.scaled_dot_product_attention(
            gather(q, q_rows),  # [S, H, L, d]
            gather(k, k_rows),  # [S, Hkv, K, d]
            gather(v, k_rows),
            attn_mask=mask,
            dropout_p=dropout if module.training else 0.0,
            scale=scaling,
            enable_gqa=heads != kv_heads,  # keys and values stay at their own head count
        )
        outputs.append(out.transpose(1, 2).reshape(-1, heads, out.shape[-1]))  # [S * L, H, d]
    flat = torch.cat(outputs) if outputs else q.new_zeros((0, heads, q.shape[-1]))
    return flat.index_select(0, rl_packed.inverse).unsqueeze(0), None  # [1, N, H, d]


def packed_hidden_states(causal_lm: Any, layout: dict[str, torch.Tensor]) -> torch.Tensor:
    """[N, H] last hidden states of the packed row under `causal_lm` (packed attention enabled on it)."""
    # A 4-D mask is taken as prepared: transformers builds none (the packed attention needs none).
    placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=layout["tokens_1N"].device)
    hidden = causal_lm.get_decoder()(
        input_ids=layout["tokens_1N"],
        position_ids=layout["positions_1N"],
        attention_mask=placeholder,
        use_cache=False,
        rl_packed=PackedSegments(layout, causal_lm.dtype),
    ).last_hidden_state
    return hidden[0]  # type: ignore[no-any-return]

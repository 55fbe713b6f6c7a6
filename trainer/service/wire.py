"""The tinker SDK's protobuf payloads for forward / forward_backward, to and from the trainer's own types.

Pure conversion, no I/O. The message classes are the ones the SDK ships (`tinker.proto.tinker_public_pb2`): the wire
types this service speaks. Every refusal is a UserError whose message names the datum, the field, the value seen
and what to send instead; the service returns it in the SDK's error format (the SDK raises RequestFailedError).
stable_reinforce's datums carry provenance (runs naming the sampled sequence behind each token); it is resolved here
against the sampler's records, looked up through a callable so that this module stays free of the store and its I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from trainer.training.batch import TrainingExample
from trainer.training.loss_params import DEFAULT_KL_COEFF, RATIO_LOSSES, LossParams

# Tinker's loss names this service computes (trainer.training.losses), and the loss_fn_config keys each takes.
LOSS_CONFIG_KEYS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset(),
    "importance_sampling": frozenset({"tis_cap"}),
    "ppo": frozenset({"clip_low_threshold", "clip_high_threshold", "tis_cap"}),
    "cispo": frozenset({"clip_low_threshold", "clip_high_threshold", "tis_cap"}),
    "grpo": frozenset({"clip_low_threshold", "clip_high_threshold", "tis_cap"}),
    "dro": frozenset({"beta"}),
    "gspo": frozenset({"clip_low_threshold", "clip_high_threshold"}),
    "stable_reinforce": frozenset({"kl_coeff"}),
}
INPUT_KEYS = frozenset({"target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask"})
SAMPLER_LOSSES = RATIO_LOSSES | {"dro", "gspo"}  # the losses that read the sampler's logprobs

_DTYPES: dict[int, Any] = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class UserError(ValueError):
    """A request this service refuses: the caller's to fix."""


@dataclass(frozen=True)
class SequenceRecord:
    """What the sampler recorded for one sampled sequence when asked to (`record_stability_info`): its request's
    prompt, its sampled tokens and the sampler's logprob of each, as the sampler computed them. stable_reinforce
    reads its sampler logprobs from here, not from the datum."""

    prompt: np.ndarray  # int32, shared by the sequences of one request
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32


# sequence_id -> its record (None: none here); a lookup counts as a use (it restarts the record's time to live)
Records = Callable[[str], SequenceRecord | None]


def _no_records(_: str) -> SequenceRecord | None:
    return None


@dataclass(frozen=True)
class Provenance:
    """A datum's loss_fn_input_spans resolved against the records: which positions hold sampled tokens, and the
    sampler's logprob of each (0 elsewhere)."""

    sampled: np.ndarray  # bool [N]
    sampler_logprobs: np.ndarray  # float32 [N]


@dataclass(frozen=True)
class SoftTargets:
    """A datum's (N, K) cross_entropy targets (Tinker's top-K distillation form): K token ids per position and a
    weight for each; the loss is -sum of weight * logprob, and the logprobs are answered in (N, K)."""

    target_ids: np.ndarray  # [N, K] int64
    weights: np.ndarray  # [N, K] float32


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    forward_only: bool
    loss: LossParams
    examples: list[TrainingExample]
    # per example: its (N, K) targets (cross_entropy), else None; then the target_ids of the example hold column 0
    soft_targets: list[SoftTargets | None] = field(default_factory=list)
    # per example: gspo's sequence_ratio_mask, else None
    sequence_masks: list[list[float] | None] = field(default_factory=list)


def _array(tensor: pb.Tensor, where: str) -> np.ndarray:
    if tensor.dtype == pb.DTYPE_BFLOAT16:
        raw = tensor.dense if tensor.WhichOneof("encoding") == "dense" else tensor.sparse_csr.values
        dense = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        if tensor.WhichOneof("encoding") == "dense":
            return dense.reshape(list(tensor.shape) or [-1])
        values = dense
    elif tensor.dtype not in _DTYPES:
        raise UserError(
            f"{where}: tensor dtype {pb.DType.Name(tensor.dtype)} is not supported (send float32 or int64)"
        )
    else:
        dtype = _DTYPES[tensor.dtype]
        if tensor.WhichOneof("encoding") == "dense":
            return np.frombuffer(tensor.dense, dtype).reshape(list(tensor.shape) or [-1])
        values = np.frombuffer(tensor.sparse_csr.values, dtype)
    shape = list(tensor.shape)
    if len(shape) != 2:
        raise UserError(f"{where}: a sparse tensor needs a 2-D shape, got {shape}")
    crow = np.frombuffer(tensor.sparse_csr.crow_indices, np.int64)
    col = np.frombuffer(tensor.sparse_csr.col_indices, np.int64)
    out = np.zeros(shape, values.dtype)
    for row in range(shape[0]):
        out[row, col[crow[row] : crow[row + 1]]] = values[crow[row] : crow[row + 1]]
    return out


def _vector(datum: pb.Datum, key: str, index: int, length: int) -> np.ndarray | None:
    if key not in datum.loss_fn_inputs:
        return None
    where = f"data[{index}].loss_fn_inputs[{key!r}]"
    values = _array(datum.loss_fn_inputs[key], where)
    if values.ndim != 1:
        values = values.reshape(-1) if values.size == length else values
    if values.ndim == 2 and values.shape[0] == length and key in ("target_tokens", "weights"):
        raise UserError(
            f"{where}: shape {list(values.shape)} (K targets per position) applies to loss_fn 'cross_entropy' "
            f"only; send shape [{length}], one value per model_input token"
        )
    if values.ndim != 1 or values.shape[0] != length:
        raise UserError(
            f"{where}: shape {list(values.shape)}, but model_input has {length} tokens; send one value per "
            "model_input token (position t scores target_tokens[t])"
        )
    return values


def _soft_targets(datum: pb.Datum, index: int, length: int) -> SoftTargets | None:
    """cross_entropy's (N, K) target_tokens with (N, K) weights, or None for the (N,) form. Weights left out are
    ones, as in the (N,) form."""
    if "target_tokens" not in datum.loss_fn_inputs:
        return None
    where = f"data[{index}].loss_fn_inputs"
    targets = _array(datum.loss_fn_inputs["target_tokens"], f"{where}['target_tokens']")
    weights = None
    if "weights" in datum.loss_fn_inputs:
        weights = _array(datum.loss_fn_inputs["weights"], f"{where}['weights']")
    if targets.ndim != 2:
        if weights is not None and weights.ndim == 2 and weights.size != length:
            raise UserError(
                f"{where}['weights']: shape {list(weights.shape)}, but target_tokens has shape "
                f"{list(targets.shape)}; send one weight per target token, of target_tokens' shape"
            )
        return None
    if targets.shape[0] != length or targets.shape[1] < 1:
        raise UserError(
            f"{where}['target_tokens']: shape {list(targets.shape)}, but model_input has {length} tokens; send "
            f"[{length}] (one target per token) or [{length}, K] with K >= 1 (K targets per token)"
        )
    if weights is None:
        weights = np.ones(targets.shape, np.float32)
    elif weights.shape != targets.shape:
        raise UserError(
            f"{where}['weights']: shape {list(weights.shape)}, but target_tokens has shape "
            f"{list(targets.shape)}; send one weight per target token, of target_tokens' shape"
        )
    if not np.isfinite(weights).all():
        raise UserError(f"{where}['weights'] holds NaN or inf")
    return SoftTargets(target_ids=targets.astype(np.int64), weights=weights.astype(np.float32))


def _tokens(datum: pb.Datum, index: int) -> list[int]:
    ids: list[int] = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(
                f"data[{index}].model_input.chunks[{j}] is {kind!r}: this service trains on text only "
                "(send ModelInput.from_ints(token ids))"
            )
        ids.extend(int(t) for t in np.frombuffer(chunk.encoded_text.tokens, np.int32))
    if not ids:
        raise UserError(f"data[{index}].model_input has no tokens")
    return ids


def _loss_params(name: str, config: dict[str, float | str]) -> LossParams:
    if name not in LOSS_CONFIG_KEYS:
        raise UserError(f"loss_fn {name!r} is not supported here; supported: {sorted(LOSS_CONFIG_KEYS)}")
    unknown = sorted(set(config) - LOSS_CONFIG_KEYS[name])
    if unknown:
        allowed = sorted(LOSS_CONFIG_KEYS[name]) or "none"
        raise UserError(f"loss_fn_config keys {unknown} do not apply to {name!r} (it takes: {allowed})")
    numbers: dict[str, float] = {}
    for key, value in config.items():
        if not isinstance(value, float):
            raise UserError(f"loss_fn_config[{key!r}] = {value!r}: a number is expected")
        numbers[key] = value
    kl_coeff = numbers.get("kl_coeff", DEFAULT_KL_COEFF)
    if not (np.isfinite(kl_coeff) and kl_coeff >= 0):
        raise UserError(
            f"loss_fn_config['kl_coeff'] = {kl_coeff!r}: send a finite number >= 0 (0 turns the KL penalty off; "
            f"the default is {DEFAULT_KL_COEFF})"
        )
    return LossParams(
        name=name,  # type: ignore[arg-type]
        clip_low_threshold=numbers.get("clip_low_threshold"),
        clip_high_threshold=numbers.get("clip_high_threshold"),
        beta=numbers.get("beta", LossParams().beta),
        tis_cap=numbers.get("tis_cap"),
        kl_coeff=kl_coeff,
    )


def _config(request: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    config: dict[str, float | str] = {k: float(v) for k, v in request.loss_fn_config.items()}
    for key, value in request.loss_fn_config_v2.items():
        config[key] = value.number if value.WhichOneof("value") == "number" else value.text
    return config


def session_of(some_id: str) -> str:
    """The session a model id (SESSION:train:N) or a sequence id (SESSION:sample:N:SEQ:I) belongs to."""
    return some_id.split(":", 1)[0]


MAX_EMPTY_SPANS = 64  # zero-length runs tolerated beyond one per position


def _spans(datum: pb.Datum, field_name: str, positions: int, where: str) -> list[tuple[str, str, int, int]]:
    """(kind, sequence_id, offset, length) of each run, kind 'prompt' or 'sampled'. Runs that tile `positions`
    tokens number at most that many (an empty run adds nothing): more is refused before any is read, so a body
    of a million empty runs costs the event loop nothing."""
    runs = getattr(datum, field_name)
    if len(runs) > positions + MAX_EMPTY_SPANS:
        raise UserError(
            f"{where}: {len(runs)} runs for {positions} positions; runs tile the field, so there are at most as "
            "many as positions (Datum.with_provenance makes one per sampled stretch)"
        )
    out = []
    for span in runs:
        kind = span.WhichOneof("span")
        arm = span.prompt_tokens if kind == "prompt_tokens" else span.sampled_tokens
        out.append(
            ("prompt" if kind == "prompt_tokens" else "sampled", arm.sequence_id, arm.offset, arm.length)
        )
    return out


def _resolve(
    spans: list[tuple[str, str, int, int]], tokens: np.ndarray, where: str, session: str, records: Records
) -> Provenance:
    """Check that the runs tile `tokens` and that each names tokens its sequence really has at that place."""
    n = len(tokens)
    sampled = np.zeros(n, bool)
    sampler = np.zeros(n, np.float32)
    position = 0
    for j, (kind, sequence_id, offset, length) in enumerate(spans):
        at = f"{where}[{j}]"
        if offset < 0 or length < 0:
            raise UserError(f"{at}: offset {offset} and length {length} must be >= 0")
        if position + length > n:
            raise UserError(
                f"{at}: the runs cover more than the field's {n} positions; they must tile it exactly "
                "(Datum.with_provenance checks this)"
            )
        if length == 0:
            continue
        if session_of(sequence_id) != session:
            raise UserError(
                f"{at}: sequence_id {sequence_id!r} was not sampled in this training client's session "
                f"({session}); provenance works within one session: sample and train in the same one"
            )
        record = records(sequence_id)
        if record is None:
            raise UserError(
                f"{at}: sequence_id {sequence_id!r} has no stability record here; sample it from a sampling client "
                "created with record_stability_info=True and wait for its result (a record is kept for one day "
                "after its last use, and not across a service restart)"
            )
        source = record.prompt if kind == "prompt" else record.tokens
        if offset + length > len(source):
            raise UserError(
                f"{at}: offset {offset} + length {length} runs past the {len(source)} {kind} tokens of sequence "
                f"{sequence_id!r}"
            )
        seen = tokens[position : position + length]
        wrong = np.flatnonzero(seen != source[offset : offset + length])
        if wrong.size:
            k = int(wrong[0])
            raise UserError(
                f"{at}: position {position + k} holds token {int(seen[k])}, but sequence {sequence_id!r} has "
                f"{int(source[offset + k])} at {kind} offset {offset + k}; a run must name the tokens as they "
                "were sampled"
            )
        if kind == "sampled":
            sampled[position : position + length] = True
            sampler[position : position + length] = record.logprobs[offset : offset + length]
        position += length
    if position != n:
        raise UserError(
            f"{where}: the runs cover {position} positions, but the field has {n}; they must tile it exactly "
            "(Datum.with_provenance checks this)"
        )
    return Provenance(sampled, sampler)


def _stable_reinforce_provenance(
    datum: pb.Datum, index: int, ids: list[int], targets: np.ndarray, session: str, records: Records
) -> Provenance:
    """stable_reinforce's provenance: model_input and target_tokens checked against what was sampled; the targets'
    spans say which positions train and with which sampler logprobs."""
    if not datum.loss_fn_input_spans or not datum.model_input_spans:
        raise UserError(
            f"data[{index}]: loss_fn 'stable_reinforce' needs provenance: attach it with Datum.with_provenance "
            "(PromptProvenanceSpan / SampledProvenanceSpan runs naming the sequence_id of each token's sample, "
            "from a sampling client created with record_stability_info=True)"
        )
    where = f"data[{index}]"
    field = f"{where}.model_input_spans"
    _resolve(_spans(datum, "model_input_spans", len(ids), field), np.asarray(ids), field, session, records)
    provenance = _resolve(
        _spans(datum, "loss_fn_input_spans", len(targets), f"{where}.loss_fn_input_spans"),
        np.asarray(targets),
        f"{where}.loss_fn_input_spans",
        session,
        records,
    )
    if not provenance.sampled.any():
        raise UserError(
            f"{where}.loss_fn_input_spans: no run is a SampledProvenanceSpan, so no target is a sampled token and "
            "stable_reinforce has nothing to train; leave this datum out"
        )
    return provenance


@dataclass(frozen=True)
class _Decoded:
    example: TrainingExample
    soft: SoftTargets | None
    sequence_mask: list[float] | None


def _check_vocabulary(values: np.ndarray, where: str, vocab_size: int) -> None:
    bad = values[(values < 0) | (values >= vocab_size)]
    if bad.size:
        raise UserError(f"{where} has token id {int(bad[0])}, outside the vocabulary [0, {vocab_size})")


def _check_required(loss: str, index: int, advantages: np.ndarray | None, sampler: np.ndarray | None) -> None:
    """Every loss but cross_entropy needs advantages; the sampler-ratio losses need the sampler's logprobs."""
    if loss != "cross_entropy" and advantages is None:
        raise UserError(f"data[{index}]: loss_fn {loss!r} needs loss_fn_inputs['advantages']")
    if loss in SAMPLER_LOSSES and sampler is None:
        raise UserError(f"data[{index}]: loss_fn {loss!r} needs loss_fn_inputs['logprobs'] (the sampler's)")


def to_example(
    datum: pb.Datum,
    index: int,
    loss: LossParams,
    vocab_size: int,
    session: str = "",
    records: Records = _no_records,
) -> _Decoded:
    unknown = sorted(set(datum.loss_fn_inputs) - INPUT_KEYS)
    if unknown:
        raise UserError(
            f"data[{index}].loss_fn_inputs has {unknown}; this service reads {sorted(INPUT_KEYS)}"
        )
    ids = _tokens(datum, index)
    n = len(ids)
    soft = _soft_targets(datum, index, n) if loss.name == "cross_entropy" else None
    targets = soft.target_ids if soft is not None else _vector(datum, "target_tokens", index, n)
    if targets is None:
        raise UserError(
            f"data[{index}].loss_fn_inputs needs 'target_tokens' ({n} ids, one per model_input token)"
        )
    for name, values in (("model_input", np.asarray(ids)), ("target_tokens", targets)):
        _check_vocabulary(values, f"data[{index}].{name}", vocab_size)
    weights = None if soft is not None else _vector(datum, "weights", index, n)
    sampler = _vector(datum, "logprobs", index, n)
    advantages = _vector(datum, "advantages", index, n)
    sequence_mask = _vector(datum, "sequence_ratio_mask", index, n) if loss.name == "gspo" else None
    _check_required(loss.name, index, advantages, sampler)
    if loss.name == "gspo" and sequence_mask is None and sampler is not None and advantages is not None:
        # tinker-cookbook's RL loop sends none and hosted Tinker takes that: the sequence's sampled tokens are the
        # positions with a sampler logprob or an advantage (a prompt position has neither).
        sequence_mask = ((sampler != 0) | (advantages != 0)).astype(np.float32)
    vectors = (weights, sampler, advantages, sequence_mask)
    for key, given in zip(("weights", "logprobs", "advantages", "sequence_ratio_mask"), vectors, strict=True):
        if given is not None and not np.isfinite(given).all():
            raise UserError(f"data[{index}].loss_fn_inputs[{key!r}] holds NaN or inf")
    if soft is not None:
        # Column 0 stands in for the targets; a position trains when any of its K weights is nonzero.
        target_ids = [int(t) for t in soft.target_ids[:, 0]]
        loss_mask = [float(row.any()) for row in soft.weights != 0]
    else:
        target_ids = [int(t) for t in targets]
        loss_mask = [float(w) for w in weights] if weights is not None else [1.0] * n
    if loss.name == "stable_reinforce":
        # Only sampled tokens train, against the logprobs the sampler recorded (a `logprobs` input is not read).
        provenance = _stable_reinforce_provenance(datum, index, ids, targets, session, records)
        loss_mask = [w if s else 0.0 for w, s in zip(loss_mask, provenance.sampled, strict=True)]
        sampler = provenance.sampler_logprobs
    example = TrainingExample(
        input_ids=ids,
        target_ids=target_ids,
        loss_mask=loss_mask,
        sampler_logprobs=[float(x) for x in sampler] if sampler is not None else [0.0] * n,
        advantages=[float(a) for a in advantages] if advantages is not None else [0.0] * n,
    )
    mask = [float(m) for m in sequence_mask] if sequence_mask is not None else None
    return _Decoded(example, soft, mask)


def decode_forward_backward(
    body: bytes, vocab_size: int, records: Records = _no_records
) -> tuple[str, int, bool, Any]:
    """(model_id, seq_id, forward_only, the call or the UserError refusing it): a refused call still takes its
    place in the model's order, so the calls after it run. `records`: the sampler's stability records, which
    stable_reinforce reads through each datum's provenance."""
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise UserError(f"the body is not a tinker ForwardBackwardRequest ({exc})") from None
    try:
        if not request.data:
            raise UserError("forward_backward needs at least one datum")
        loss = _loss_params(request.loss_fn, _config(request))
        session = session_of(request.model_id)
        decoded = [to_example(d, i, loss, vocab_size, session, records) for i, d in enumerate(request.data)]
        call: Any = ForwardBackwardCall(
            request.model_id,
            request.seq_id,
            request.forward_only,
            loss,
            [d.example for d in decoded],
            soft_targets=[d.soft for d in decoded],
            sequence_masks=[d.sequence_mask for d in decoded],
        )
    except UserError as exc:
        call = exc
    return request.model_id, request.seq_id, request.forward_only, call


def encode_forward_backward(
    logprobs: Sequence[Sequence[float] | np.ndarray], metrics: dict[str, float]
) -> bytes:
    """ForwardBackwardOutput: each datum's target logprobs, (N,) or (N, K) as its target_tokens, and metrics named
    `name:reduction` as the SDK requires. One ArrayRecord per run of datums with one trailing shape: the SDK reads
    a record's datums as [len, *trailing_shape]."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    arrays = [np.asarray(lp, np.float32) for lp in logprobs]
    start = 0
    while start < len(arrays):
        trailing = arrays[start].shape[1:]
        stop = start + 1
        while stop < len(arrays) and arrays[stop].shape[1:] == trailing:
            stop += 1
        record = out.loss_fn_outputs.add()
        record.num_datums = stop - start
        tensor = record.fields["logprobs"]
        tensor.dtype = pb.DTYPE_FLOAT32
        tensor.trailing_shape.extend(trailing)
        tensor.data = b"".join(a.tobytes() for a in arrays[start:stop])
        tensor.offsets = np.cumsum([0] + [a.nbytes for a in arrays[start:stop]]).astype(np.int64).tobytes()
        start = stop
    return out.SerializeToString()


@dataclass
class Result:
    """What a training client's call answers once done: a JSON body, or a proto message's bytes."""

    body: bytes | dict[str, Any]
    proto: bool = False


def body_field(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise UserError(f"{key!r} must be a {kind.__name__}, got {value!r}")
    return value


def call_of(body: dict[str, Any]) -> tuple[str, int]:
    """An existing training client's call: its model id and its seq_id (its place in the client's order)."""
    return body_field(body, "model_id", str), body_field(body, "seq_id", int)

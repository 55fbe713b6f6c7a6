"""HTTP bodies of the gateway, shared by the gateway (server) and the trainer (client). Pydantic only.

Two `/generate` dialects arrive from atroposlib 0.4.0's ManagedServer clients (its vllm_server.py and
sglang_server.py):
- vLLM style (`server_type: vllm`): {"prompt": {"prompt_token_ids": [...]}, "logprobs": 0, "n", "max_tokens", ...}
  answered with {"logprobs": [n x [[{"<id>": lp}] per token]], "finish_reasons": [n x str]}. Its get_logprobs
  sends {"prompt": {"prompt_token_ids": [...]}, "prompt_logprobs": k, "n": 1, "temperature": 0.0, "top_p": 1.0,
  "max_tokens": 1} and reads "prompt_logprobs": one entry per prompt position, None for the first, then
  {"<id>": lp, ...} with the prompt token's own first and the top k after it (vLLM's order).
- SGLang style (`server_type: sglang`): {"input_ids": [...], "sampling_params": {...}, "return_logprob": true}
  answered with {"meta_info": {"output_token_logprobs": [[lp, id, text], ...], "finish_reason": {...}}} (a list
  of those when n > 1).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from rlcommon.model_identity import ModelIdentity

# Every integer that reaches vLLM or an array is bounded here; every float is finite.
MAX_TOKEN_ID = 2**31 - 1  # vocabularies are far smaller; the gateway also checks against the served vocab
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Count = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: top-k logprobs per position above it are refused by vLLM
TopK = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]


class SamplingParams(BaseModel):
    """The sampling parameters the gateway forwards, each with its type and range (vLLM's own limits, and
    integers that fit its arrays). Unknown keys are refused, naming the supported ones."""

    model_config = ConfigDict(extra="forbid")

    temperature: Annotated[Finite, Field(ge=0, le=1e4)] | None = None
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=MAX_TOKEN_ID)] | None = None
    min_p: Annotated[Finite, Field(ge=0, le=1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)] | None = None
    repetition_penalty: Annotated[Finite, Field(gt=0, le=1e4)] | None = None
    presence_penalty: Annotated[Finite, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Finite, Field(ge=-2, le=2)] | None = None
    ignore_eos: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    min_tokens: Count | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    logit_bias: dict[str, Annotated[Finite, Field(ge=-100, le=100)]] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None  # top-k per prompt position, besides the prompt token's own logprob

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def _prompt_top_k(cls, value: Any) -> Any:
        # One message that says what the number means and what to send (pydantic's would only give the bound).
        # vLLM's -1 ("the whole vocabulary") is refused: a vocabulary per position is too big to answer.
        if value is None or (type(value) is int and 0 <= value <= MAX_LOGPROBS):
            return value
        raise ValueError(
            f"expected an integer from 0 to {MAX_LOGPROBS}: the number of top logprobs per prompt position "
            "besides the prompt token's own (0 = only its own); send a value in that range"
        )

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit() or int(key) > MAX_TOKEN_ID:
                raise ValueError(f"logit_bias keys are token ids (0..{MAX_TOKEN_ID}), got {key!r}")
        return value


# Sampling parameters forwarded to vLLM; anything else is refused with a 400 naming the key.
FORWARDED_SAMPLING_KEYS = frozenset(SamplingParams.model_fields)


class OpenAIBodyLimits(SamplingParams):
    """The numbers of an OpenAI completions/chat body, checked before the body goes anywhere; its other keys
    (model, messages, prompt, ...) are left to the route and to vLLM."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKEN_ID)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKEN_ID)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1024)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=1024)] | None = None
    logprobs: StrictBool | TopK | None = None
    top_logprobs: TopK | None = None
    echo: StrictBool | None = None
    stream: StrictBool | None = None


class SamplingRequest(BaseModel):
    """A dialect-free sampling request: what both /generate formats are turned into."""

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[TokenId] = Field(min_length=1)
    n: StrictInt = Field(1, ge=1, le=1024)
    max_tokens: StrictInt = Field(16, ge=1, le=MAX_TOKEN_ID)
    sampling: dict[str, Any] = Field(default_factory=dict)

    @field_validator("sampling")
    @classmethod
    def _known_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - FORWARDED_SAMPLING_KEYS)
        if unknown:
            raise ValueError(
                f"unsupported sampling parameter(s) {unknown}; supported: {sorted(FORWARDED_SAMPLING_KEYS)}"
            )
        return value


class Sample(BaseModel):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # Asked with prompt_logprobs: per prompt position (None for the first, which has no context), token id ->
    # logprob, the prompt token's own first. The same for every sample of one request.
    prompt_logprobs: list[dict[int, float] | None] | None = None


class VLLMPrompt(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_token_ids: list[TokenId] = Field(min_length=1)


class VLLMGenerateRequest(BaseModel):
    """What atroposlib's VLLMServer posts to {root}/generate. Unknown keys are sampling parameters."""

    model_config = ConfigDict(extra="allow")

    prompt: VLLMPrompt
    n: StrictInt = Field(1, ge=1, le=1024)
    max_tokens: StrictInt = Field(16, ge=1, le=MAX_TOKEN_ID)
    logprobs: TopK | None = 0

    def to_sampling(self) -> SamplingRequest:
        extra = dict(self.model_extra or {})
        extra.pop("model", None)
        return SamplingRequest(
            prompt_token_ids=self.prompt.prompt_token_ids,
            n=self.n,
            max_tokens=self.max_tokens,
            sampling=extra,
        )


class SGLangGenerateRequest(BaseModel):
    """What atroposlib's SGLangServer (and tinker-atropos) post to {root}/generate."""

    model_config = ConfigDict(extra="allow")

    input_ids: list[TokenId] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_logprob: StrictBool = True

    def to_sampling(self) -> SamplingRequest:
        params = dict(self.sampling_params)
        n = params.pop("n", 1)
        max_tokens = params.pop("max_new_tokens", params.pop("max_tokens", 16))
        params.pop("model", None)
        return SamplingRequest(prompt_token_ids=self.input_ids, n=n, max_tokens=max_tokens, sampling=params)


def vllm_generate_response(samples: list[Sample], version: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "logprobs": [[[{str(t): lp}] for t, lp in zip(s.token_ids, s.logprobs)] for s in samples],
        "finish_reasons": [s.finish_reason for s in samples],
        "token_ids": [s.token_ids for s in samples],
        "policy_version": version,
    }
    if samples and samples[0].prompt_logprobs is not None:
        # One flat list (the prompt is shared by the n samples). atroposlib also reads [sequence][position], and
        # tells the two apart by whether the first entry is a list: ours is None or a dict, never a list.
        body["prompt_logprobs"] = [
            None if pos is None else {str(t): lp for t, lp in pos.items()}
            for pos in samples[0].prompt_logprobs
        ]
    return body


def sglang_generate_response(
    samples: list[Sample], version: int, prompt_len: int
) -> dict[str, Any] | list[Any]:
    def one(s: Sample) -> dict[str, Any]:
        finish: dict[str, Any] = {"type": s.finish_reason}
        if s.finish_reason == "length":
            finish["length"] = len(s.token_ids)
        elif s.stop_reason is not None:
            finish["matched"] = s.stop_reason
        return {
            "output_ids": s.token_ids,
            "meta_info": {
                "output_token_logprobs": [[lp, t, None] for t, lp in zip(s.token_ids, s.logprobs)],
                "finish_reason": finish,
                "prompt_tokens": prompt_len,
                "completion_tokens": len(s.token_ids),
                "policy_version": version,
            },
        }

    # SGLang answers one object for n == 1 and a list for n > 1; Atropos's client accepts both.
    return one(samples[0]) if len(samples) == 1 else [one(s) for s in samples]


MAX_PROBE_PROMPTS = 16
TokenKey = Annotated[
    int, Field(ge=0, le=MAX_TOKEN_ID)
]  # a token id as a JSON object key (a string on the wire)


ProbeTopLogprobs = list[
    Annotated[dict[TokenKey, Annotated[Finite, Field(le=0)]], Field(min_length=1, max_length=MAX_LOGPROBS)]
]
ProbeStatistic = Literal["max", "mean"]
ProbeReferenceName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")]


class PublishProbe(BaseModel):
    """A few fixed prompts and, for each, the trainer's own top-k logprobs of the next token (token id -> logprob).
    inference/policy/probe_check.py says how they are compared."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[Annotated[list[TokenId], Field(min_length=1, max_length=4096)]] = Field(
        min_length=1, max_length=MAX_PROBE_PROMPTS
    )
    top_logprobs: ProbeTopLogprobs = Field(min_length=1, max_length=MAX_PROBE_PROMPTS)
    tolerance: Annotated[Finite, Field(gt=0, le=10)]
    statistic: ProbeStatistic = Field(
        "max",
        description="max: the largest |vLLM - trainer| must be within tolerance (float32 end to end); mean: the "
        "mean, within a tolerance calibrated on the base model that `tolerance` only floors (any bfloat16)",
    )
    references: dict[ProbeReferenceName, ProbeTopLogprobs] = Field(
        default_factory=dict,
        max_length=4,
        description="the trainer's top-k logprobs under weights the served adapter could wrongly be ('base': the "
        "adapter off, which also calibrates the mean statistic; 'previous': the last verified version)",
    )
    adapter_effect: Annotated[Finite, Field(ge=0, le=1e4)] | None = Field(
        None,
        description="mean |trainer logprob with the adapter - without| over the expected top-k ids: the bf16 "
        "rounding of an adapter grows with it, so the mean statistic's calibrated tolerance allows a share of it",
    )
    logit_spacing: Annotated[Finite, Field(ge=0, le=1e4)] | None = Field(
        None,
        description="mean over the prompts of the spacing of representable logits (in the coarser of the trainer's "
        "and vLLM's dtypes) at the largest expected top-k logit: one rounding step there moves a prompt's "
        "logprobs by up to this much, so the mean statistic's calibrated tolerance adds it",
    )

    @model_validator(mode="after")
    def _aligned(self) -> PublishProbe:
        for name, tops in [("top_logprobs", self.top_logprobs)] + [
            (f"references.{key}", value) for key, value in self.references.items()
        ]:
            if len(self.prompts) != len(tops):
                raise ValueError(
                    f"probe: {len(self.prompts)} prompts but {len(tops)} {name}; send one "
                    "{token id: logprob} map per prompt"
                )
        return self


class PublishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: StrictInt = Field(
        ge=0,
        le=2**62,
        description="policy version; must exceed the current one unless replace_newer (0 = the base model)",
    )
    adapter_path: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="folder with adapter_config.json + adapter_model.safetensors; null only for version 0",
    )
    replace_newer: StrictBool = Field(
        False,
        description="the trainer restarted from a checkpoint: this version becomes current and every version "
        "above it is retracted (what they sampled is never attributed to a version again)",
    )
    probe: PublishProbe | None = Field(
        None,
        description="check the loaded adapter before it serves: the gateway decodes the probe greedily on it and "
        "compares vLLM's sampled-token logprobs with the trainer's; a mismatch refuses the publish (422)",
    )

    @model_validator(mode="after")
    def _base_or_adapter(self) -> PublishRequest:
        if self.version == 0 and self.adapter_path is not None:
            raise ValueError("adapter_path: version 0 is the base model and takes no adapter; send null")
        if self.version == 0 and not self.replace_newer:
            raise ValueError(
                "replace_newer: version 0 (the base model) only becomes current again by a rollback; "
                "send replace_newer: true"
            )
        if self.version > 0 and self.adapter_path is None:
            raise ValueError(
                f"adapter_path: version {self.version} needs an adapter folder (null is for version 0 only)"
            )
        return self


class PublishResponse(BaseModel):
    version: int
    lora_name: str
    load_s: float
    unloaded: list[int]
    noop: bool = False  # the version was current already, with this adapter: nothing changed
    retracted: list[int] = Field(default_factory=list)  # versions a replace_newer publish abandoned
    # The on-policy gate this publish opened: how long it held new requests, and how many it held.
    hold_s: float = 0.0
    held_requests: int = 0
    # The probe check (null without a probe): largest and mean |vLLM - trainer| logprob over the compared
    # positions, the tolerance applied to the probe's statistic (calibrated for `mean`), the base model's own
    # mean difference that calibrated it (a rolling estimate), and how far the wrong candidates sat (inference/policy/probe_check.py).
    verify_max_abs_diff: float | None = None
    verify_mean_abs_diff: float | None = None
    verify_tolerance: float | None = None
    verify_noise: float | None = None
    verify_margin: float | None = None  # the share of the tolerance left unused: 1 exact, 0 at the edge
    verify_separation: float | None = None
    verify_s: float | None = None


MAX_ENVS = 256  # environments of a mixed run the gate keeps quotas for
EnvName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]


class ExpectRequest(BaseModel):
    """The trainer took a batch and will publish `version`: hold new generation requests until it is current, for
    at most `hold_s`. A version that is not newer than the current one opens the gate (the step made no update)."""

    model_config = ConfigDict(extra="forbid")

    version: StrictInt = Field(ge=0, le=2**62)
    hold_s: Annotated[Finite, Field(gt=0, le=3600)] = 120.0
    quota: StrictInt | None = Field(
        None,
        ge=1,
        le=2**31,
        description="sequences allowed on each version from its publish on (the trainer's batch); further "
        "requests wait for the next version, or for refill_s once nothing runs on the current one",
    )
    env_quotas: (
        Annotated[dict[EnvName, Annotated[StrictInt, Field(ge=1, le=2**31)]], Field(max_length=MAX_ENVS)]
        | None
    ) = Field(
        None,
        description="a mixed run: sequences each environment may start on a version (its share of the batch); "
        "a request is the environment its bearer key names (rlcommon/envkeys.py), others count against `quota`",
    )
    refill_s: Annotated[Finite, Field(gt=0, le=600)] = 1.0
    group_size: StrictInt | None = Field(
        None,
        ge=1,
        le=2**20,
        description="samples per prompt: the first request of a prompt on a version reserves this many against "
        "`quota`, and the prompt's further requests pass until they are used (a group asked for one rollout at a "
        "time starts whole on one version)",
    )
    env_group_sizes: (
        Annotated[dict[EnvName, Annotated[StrictInt, Field(ge=1, le=2**20)]], Field(max_length=MAX_ENVS)]
        | None
    ) = Field(None, description="a mixed run: `group_size` of each environment of `env_quotas`")
    lead: StrictInt = Field(
        0,
        ge=0,
        le=64,
        description="without the gate: versions environments may sample ahead of the trainer; the first version "
        "opened under new quotas allows 1 + lead times each (inference/policy/gate.py set_quota)",
    )
    batch_taken: bool = Field(
        False,
        description="the trainer took a batch that made no update (no new version comes for it): the current "
        "version's quotas start over, as a publish would start the next version's",
    )


class RefillRequest(BaseModel):
    """POST /policy/refill: the trainer waits for a batch these environments of a mixed run are short of (sequences
    run-api lacks of each one's share): when nothing runs on the current version, let what each holds over its
    quota through on it (inference/policy/gate.py)."""

    model_config = ConfigDict(extra="forbid")

    short: Annotated[
        dict[EnvName, Annotated[StrictInt, Field(ge=0, le=2**31)]], Field(min_length=1, max_length=MAX_ENVS)
    ]


class RefillResponse(BaseModel):
    refilled: list[str]  # the environments let through; empty when something still runs or the gate is closed


class ExpectResponse(BaseModel):
    holding_for: int | None  # the version new requests wait for; null when the gate is open
    hold_s: float = 0.0  # when this call opened the gate: how long it had been closed
    held_requests: int = 0


MAX_LOOKUP_SEQUENCES = 1_000_000  # a trainer's batch asks about far fewer


class LookupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sequences: list[list[TokenId]] = Field(
        max_length=MAX_LOOKUP_SEQUENCES, description="prompt + completion token ids, as in run-api's `tokens`"
    )


class LookupResponse(BaseModel):
    versions: list[int | None]


class PolicyStatus(BaseModel):
    instance: str  # chosen when the gateway process starts: another value means the gateway was restarted
    generation: int  # rollbacks (replace_newer publishes that retracted versions) since it started
    current_version: int
    loaded_versions: list[int]
    in_flight: dict[int, int]
    healthy: bool
    state: str
    restarts: int
    restart_reasons: list[str] = Field(default_factory=list)  # the sampler's last crash restarts, why each
    backend_url: str | None = None
    backend_pid: int | None = None
    backend_pids: list[int | None] = Field(default_factory=list)
    # Generation requests (/generate, /v1/completions, /v1/chat/completions) since the gateway started, and those
    # answered >= 400, by reason (inference.errors.Reason: "invalid_request", "prompt_too_long", "not_ready", ...).
    # Defaults: a client parses a gateway that predates them.
    requests_total: int = 0
    rejected_total: int = 0
    rejected_by_reason: dict[str, int] = Field(default_factory=dict)
    last_rejection: str | None = None  # "<UTC time> <route> <status> <reason>: <message, 300 chars at most>"
    # The on-policy gate (inference/policy/gate.py): the version new requests wait for (null: open), requests waiting
    # now, requests ever held, and closings that ended at their deadline (no publish came).
    gate_waiting_for: int | None = None
    gate_holding: int = 0
    gate_held_total: int = 0
    gate_expired_total: int = 0
    gate_deadline_passes_total: int = 0  # requests served on the current version because their hold ran out
    gate_refills_total: int = 0  # times requests over the quota went through on the current version after all
    gate_carried_total: int = (
        0  # sequences taken off a version's quota for what the one before started beyond it
    )
    gate_continuations_total: int = 0  # episode turns let through as continuations (inference/policy/gate.py)
    gate_group_passes_total: int = 0  # requests let through as the rest of a group admitted on their version
    gate_released_total: int = 0  # samples of group reservations given back unused (a prompt asked for once)
    continuations_moved_total: int = 0  # of those, sampled on the current version: their episode's was gone
    # Sequences started on the current version by each environment its bearer key named (rlcommon/envkeys.py), and
    # by requests naming none ("" key); a mixed run's quota holds each named one to its share.
    gate_started_by_env: dict[str, int] = Field(default_factory=dict)


class NamedAdapterLoad(BaseModel):
    """POST /adapters/load: serve the PEFT folder `adapter_path` under `name` (inference/http/named_adapters.py)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    adapter_path: str = Field(min_length=1)


class NamedAdapterLoaded(BaseModel):
    name: str
    lora_name: str
    load_s: float
    noop: bool = False  # it was loaded already (a retried load)


class NamedAdapterUnload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedSampleResponse(BaseModel):
    """POST /adapters/generate: the samples of one prompt, with their logprobs (and prompt logprobs when asked)."""

    adapter: str | None
    samples: list[Sample]


# --- a shared engine (launch.sh engine): runs attach one at a time through a lease --------------------------------

LEASE_HEADER = (
    "X-Engine-Lease"  # on publish, expect and refill: the run's lease id, when the gateway is an engine
)


class AttachRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    holder: str = Field(min_length=8, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    who: str = Field(max_length=512)  # for people: the run folder, the launcher's host and PID
    model: ModelIdentity  # the run's model folder: the engine refuses another
    max_staleness: int = Field(ge=0)  # the run's: the engine must keep that many versions loaded


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    holder: str = Field(min_length=8, max_length=128)


class LeaseStatus(BaseModel):
    who: str
    held_s: float
    expires_in_s: float


class EngineStatus(BaseModel):
    instance: str  # as PolicyStatus's: another value means the gateway restarted (and forgot its lease)
    model: ModelIdentity
    keep_versions: int
    named_slots: int
    vllm_dtype: str
    vllm: dict[str, Any] = Field(default_factory=dict)  # the engine's vLLM settings (never its key)
    lease_ttl_s: float
    runs: int  # runs attached since the gateway started
    lapsed: int  # leases that ran out without a release
    lease: LeaseStatus | None = None  # who holds it: for the publish token's holders only


class AttachResponse(BaseModel):
    engine: EngineStatus
    new_run: bool  # the engine started from a clean policy state (False: this holder held it already)
    unloaded: list[str] = Field(default_factory=list)  # the previous run's adapters, unloaded

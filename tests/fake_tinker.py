"""A stand-in for Tinker's service at the SDK boundary, built from real tinker types (TrainingClient and
SamplingClient subclasses, ForwardBackwardOutput, SampleResponse/SampledSequence, AwaitableConcurrentFuture),
computing with the offline tiny model. Training runs our local backend with Tinker's loss names; sampling runs
transformers(+peft) with full-softmax sampling. Weights live on disk under $FAKE_TINKER_ROOT, named by
`tinker://fake/<folder>` paths, so the trainer and gateway processes share them as they would share Tinker.

Used as `tinker.client_factory=tests.fake_tinker:make_service_client`.
"""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import tinker
import torch
from tinker import types
from tinker.lib.public_interfaces import AwaitableConcurrentFuture

from trainer.training.backend import AdamParams
from trainer.training.batch import TrainingExample
from trainer.training.config import RunConfig
from trainer.training.loss_params import LossParams

PREFIX = "tinker://fake"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def done(value: Any) -> AwaitableConcurrentFuture:
    fut: Future = Future()
    fut.set_result(value)
    return AwaitableConcurrentFuture(fut)


def root() -> Path:
    path = Path(os.environ.get("FAKE_TINKER_ROOT", "/tmp/fake-tinker"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def to_folder(tinker_path: str) -> Path:
    if not tinker_path.startswith(PREFIX):
        raise ValueError(f"not a fake tinker path: {tinker_path}")
    return Path(tinker_path[len(PREFIX) :])


class FakeTrainingClient(tinker.TrainingClient):
    def __init__(self, base_model: str, rank: int, seed: int | None = None, state: str | None = None):
        from trainer.backends.local import LocalBackend

        self.model_id = f"fake:{uuid.uuid4().hex[:8]}"
        self.run_dir = root() / self.model_id.replace(":", "-")
        cfg = RunConfig.model_validate(
            {
                "model": {"path": base_model, "device": "cpu", "dtype": "float32"},
                "lora": {"rank": rank, "alpha": 4 * rank, "target_modules": LORA_TARGETS, "seed": seed or 0},
                "trainer": {"output_dir": str(self.run_dir), "max_seq_len": 2048, "micro_batch_tokens": 8192},
            }
        )
        self.backend = LocalBackend(cfg)
        if state is not None:
            self.backend.load_state(str(to_folder(state)))
        self._lock = threading.Lock()

    def get_telemetry(self) -> None:
        return None

    def forward_backward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: Any = None) -> Any:
        cfg = dict(loss_fn_config or {})
        examples = []
        for datum in data:
            inputs = datum.loss_fn_inputs
            targets = [int(t) for t in inputs["target_tokens"].tolist()]
            n = len(targets)
            weights = inputs["weights"].tolist() if "weights" in inputs else [1.0] * n
            examples.append(
                TrainingExample(
                    input_ids=datum.model_input.to_ints(),
                    target_ids=targets,
                    loss_mask=[float(w) for w in weights],
                    sampler_logprobs=inputs["logprobs"].tolist() if "logprobs" in inputs else [0.0] * n,
                    advantages=inputs["advantages"].tolist() if "advantages" in inputs else [0.0] * n,
                )
            )
        # Tinker sums over every token of every datum; positions that should not train carry advantage 0.
        loss = LossParams(
            name=loss_fn,
            clip_low_threshold=cfg.get("clip_low_threshold"),  # type: ignore[arg-type]
            clip_high_threshold=cfg.get("clip_high_threshold"),
        )
        with self._lock:
            result = self.backend.forward_backward(examples, loss, "sum")
        outputs = [
            {"logprobs": types.TensorData.from_torch(torch.tensor(lp, dtype=torch.float32))}
            for lp in result.trainer_logprobs
        ]
        return done(
            types.ForwardBackwardOutput(
                loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics={"loss:sum": result.loss}
            )
        )

    def optim_step(self, optim_params: Any = None, *, adam_params: Any = None) -> Any:
        p = optim_params or adam_params
        with self._lock:
            metrics = self.backend.optim_step(
                AdamParams(
                    learning_rate=p.learning_rate,
                    beta1=p.beta1,
                    beta2=p.beta2,
                    eps=p.eps,
                    weight_decay=p.weight_decay,
                    grad_clip_norm=p.grad_clip_norm,
                )
            )
        return done(types.OptimStepResponse(metrics={"grad_norm:mean": metrics["optim/grad_norm"]}))

    def save_weights_for_sampler(self, name: str, ttl_seconds: Any = None, user_metadata: Any = None) -> Any:
        with self._lock:
            folder = self.backend.save_for_sampler(int(name.lstrip("v")))
        return done(types.SaveWeightsForSamplerResponse(path=f"{PREFIX}{folder}"))

    def save_state(
        self, name: str, ttl_seconds: Any = None, overwrite: bool = False, user_metadata: Any = None
    ) -> Any:
        with self._lock:
            folder = self.backend.save_state(f"{name}-{uuid.uuid4().hex[:6]}")
        return done(types.SaveWeightsResponse(path=f"{PREFIX}{folder}"))


class FakeSamplingClient(tinker.SamplingClient):
    def __init__(self, base_model: str, adapter: Path | None):
        from transformers import AutoModelForCausalLM

        from trainer.backends.local import resolve_model_path

        self._base_model = base_model
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(base_model), dtype=torch.float32)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter))
        self.model = model.eval()
        self.eos_ids = set(
            model.config.eos_token_id
            if isinstance(model.config.eos_token_id, list)
            else [model.config.eos_token_id]
        )
        self._lock = threading.Lock()

    def get_telemetry(self) -> None:
        return None

    @torch.no_grad()
    def sample(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        **_: Any,
    ) -> Any:
        ids = torch.tensor([prompt.to_ints()] * num_samples)
        stop_ids = {s for s in (sampling_params.stop or []) if isinstance(s, int)} | self.eos_ids
        tokens: list[list[int]] = [[] for _ in range(num_samples)]
        logprobs: list[list[float]] = [[] for _ in range(num_samples)]
        finished = [False] * num_samples
        with self._lock:
            for _ in range(sampling_params.max_tokens or 16):
                logits = self.model(ids).logits[:, -1].double() / max(sampling_params.temperature, 1e-6)
                logp = torch.log_softmax(logits, dim=-1)
                picked = torch.multinomial(logp.exp(), 1).squeeze(1)
                for i in range(num_samples):
                    if not finished[i]:
                        tokens[i].append(int(picked[i]))
                        logprobs[i].append(float(logp[i, picked[i]]))
                        finished[i] = int(picked[i]) in stop_ids
                ids = torch.cat([ids, picked[:, None]], dim=1)
                if all(finished):
                    break
        sequences = [
            types.SampledSequence(
                stop_reason="stop" if finished[i] else "length",
                sequence_id=uuid.uuid4().hex,
                _tokens_list=tokens[i],
                _logprobs_list=logprobs[i],
            )
            for i in range(num_samples)
        ]
        return done(types.SampleResponse(sequences=sequences))

    @torch.no_grad()
    def compute_logprobs(self, prompt: types.ModelInput, prompt_logprobs_last_n: int | None = None) -> Any:
        """Each prompt token's logprob given the tokens before it (None for the first, and before the last n)."""
        ids = prompt.to_ints()
        with self._lock:
            logits = self.model(torch.tensor([ids])).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1)
        values: list[float | None] = [None] + [float(lp[t - 1, ids[t]]) for t in range(1, len(ids))]
        if prompt_logprobs_last_n is not None:
            cut = len(ids) - prompt_logprobs_last_n
            values = [None] * cut + values[cut:]
        return done(values)


class FakeServiceClient:
    """The ServiceClient methods the backends call, returning what Tinker returns."""

    def get_server_capabilities(self) -> Any:
        """Blocking, as the SDK's (deprecated) ServiceClient method is: no future."""
        return types.GetServerCapabilitiesResponse(
            supported_models=[types.SupportedModel(model_name="tiny", trainable=True, sampleable=True)]
        )

    def create_rest_client(self) -> Any:
        service = self

        class Rest:
            def get_server_capabilities(self) -> Any:
                return done(service.get_server_capabilities())

        return Rest()

    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None, **_: Any
    ) -> Any:
        return done(FakeTrainingClient(base_model, rank, seed))

    def create_training_client_from_state_with_optimizer(self, path: str, **_: Any) -> Any:
        import json

        state = json.loads((to_folder(path) / "run_config.json").read_text())
        return done(
            FakeTrainingClient(state["model"]["path"], state["lora"]["rank"], state["lora"]["seed"], path)
        )

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None, **_: Any
    ) -> Any:
        if model_path is not None:
            import json

            folder = to_folder(model_path)
            base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
            return done(FakeSamplingClient(base, folder))
        assert base_model is not None
        return done(FakeSamplingClient(base_model, None))


def make_service_client() -> FakeServiceClient:
    return FakeServiceClient()

"""How long a request may wait at the gateway, which the trainer, the gateway and the environments' clients must
agree on: a client that gives up sooner than the gateway may hold it turns a slow answer into a lost rollout."""

from __future__ import annotations

GATE_HOLD_S = 120.0  # publish.gate_hold_s's default: the longest the on-policy gate holds a request
GATEWAY_REQUEST_TIMEOUT_S = (
    600.0  # inference.request_timeout_s's default: one request from the gateway to vLLM
)
# A request held its longest may then meet a vLLM that is restarting: the gateway waits for it within its own
# request timeout, and the client allows this much more for the answer to travel back.
CLIENT_SLACK_S = 30.0


def model_call_timeout_s(
    gate_hold_s: float = GATE_HOLD_S, request_timeout_s: float = GATEWAY_REQUEST_TIMEOUT_S
) -> float:
    """How long an environment's client waits for one model call through the gateway: the gate's hold, then the
    gateway's request to vLLM, then the slack."""
    return gate_hold_s + request_timeout_s + CLIENT_SLACK_S

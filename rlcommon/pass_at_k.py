"""The one rule pass@k sampling must follow, checked where the trainer reads eval.* and where an environment reads
its --env.eval_* flags."""

from __future__ import annotations


def greedy_pass_at_k_problem(k: int, temperature: float, k_name: str, temperature_name: str) -> str | None:
    """Why `k` samples at `temperature` cannot measure pass@k, or None: greedy samples of one prompt are identical."""
    if k > 1 and temperature == 0:
        return (
            f"{k_name}={k} with {temperature_name}=0: greedy samples of one prompt are identical, so pass@k would "
            f"equal pass@1; set {temperature_name} > 0 (e.g. 1.0) for pass@k, or {k_name}=1 for greedy pass@1"
        )
    return None

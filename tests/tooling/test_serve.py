"""`vllm-treespec serve` starts vLLM's OpenAI server on CPU with a tree method and answers a chat request."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.engine

STARTUP_TIMEOUT_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_openai_chat_with_graft(tmp_path):
    import urllib.request

    from openai import OpenAI

    from vllm_treespec.tools.models import ensure_smollm2

    model = str(ensure_smollm2())
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm_treespec.tools.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--served-model-name", "smollm2",
         "--speculative-config", json.dumps({"method": "graft", "num_speculative_tokens": 16})],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy in time"
            time.sleep(2)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0)
        assert "Paris" in reply.choices[0].message.content
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert "vllm:spec_decode_num_drafts" in metrics
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()

"""`vllm-treespec serve` (vLLM's OpenAI server) with graft: an OpenAI client's chat, a short soak, bad requests and
bad startup configs.

Real servers (``python -m vllm_treespec.tools.cli serve``) on 127.0.0.1 and a real HTTP client; every loop is bounded.
The long versions are ``scripts/soak.sh`` (500+ requests) and ``scripts/bad_input.py`` (every bad config as a real
startup).
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from vllm_treespec.tools import soak
from vllm_treespec.tools.serving import ServerProcess, ServerStartError, client_session, request

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

SPEC = {"method": "graft", "num_speculative_tokens": 16}
CONCURRENCY = 16
SOAK_REQUESTS = 48  # every kind of request at least once (soak.make_requests, seed 1)
# the two servers of this module may be up at once: keep their KV caches small
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}


#: (request body without "model", endpoint under /v1/): each must get a 4xx
BAD_REQUESTS = [
    ({"prompt": "hi", "max_tokens": -1}, "completions"),
    ({"prompt": "hi", "max_tokens": "ten"}, "completions"),
    ({"prompt": "hi", "max_tokens": 100000}, "completions"),
    ({"prompt": "hi", "temperature": -1}, "completions"),
    ({"prompt": "hi", "top_p": 1.5}, "completions"),
    ({"prompt": "hi", "top_k": -7}, "completions"),
    ({"prompt": "hi", "presence_penalty": 9}, "completions"),
    ({"prompt": "hi", "logprobs": 1000}, "completions"),
    ({"prompt": "hi", "n": 0}, "completions"),
    ({"prompt": "hi", "stop": 42}, "completions"),
    ({"prompt": "word " * 3000, "max_tokens": 4}, "completions"),
    ({"max_tokens": 4}, "completions"),
    ({"prompt": "hi", "model": "no-such-model"}, "completions"),
    ({"messages": "not a list"}, "chat/completions"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "chat/completions"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "chat/completions"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "completions"),
]


def _args(max_model_len: int = 1024) -> list[str]:
    return soak.server_args("float32", max_model_len, CONCURRENCY, enforce_eager=True)


@pytest.fixture(scope="module")
def smollm2() -> str:
    from vllm_treespec.tools.models import ensure_smollm2

    return str(ensure_smollm2())


@pytest.fixture(scope="module")
def spec_server(smollm2):
    with ServerProcess(smollm2, SPEC, _args(), env=SERVER_ENV) as server:
        yield server


@pytest.fixture(scope="module")
def soak_run(spec_server):
    requests = soak.make_requests(SOAK_REQUESTS, seed=1)
    report, replies = soak.run_soak(spec_server, requests, CONCURRENCY)
    print("\nsoak:", report.summary())
    return requests, report, replies


def test_soak_no_crash_no_lost_requests(soak_run):
    requests, report, _ = soak_run
    assert set(report.by_kind) == set(soak.KINDS), "every kind of request is in the mix"
    assert report.lost == [] and report.invalid == []
    assert report.server_alive and report.server_healthy
    assert report.completed + report.aborted_by_client == report.sent == len(requests)
    assert report.aborted_by_client >= 1, "the mix aborts streams mid-way"


def test_soak_memory_stays_bounded(soak_run):
    _, report, _ = soak_run
    rss = report.rss
    assert rss["samples"] >= 5
    # RSS may grow by the 1 GiB KV cache as its pages are first touched, plus allocator slack. This guards against
    # gross growth only (a copy of a buffer per step, say); scripts/soak.sh runs long enough to show a slow trend.
    assert rss["max_mib"] - rss["start_mib"] < 1024 + 512, rss
    assert rss["end_mib"] - rss["mid_mib"] < 256, rss


@pytest.mark.parametrize("payload,endpoint", BAD_REQUESTS, ids=lambda v: v if isinstance(v, str) else json.dumps(v)[:50])
def test_bad_request_gets_4xx_and_server_survives(spec_server, soak_run, payload, endpoint):
    async def go():
        body = {"model": soak.SERVED_NAME, **payload}
        async with client_session() as session:
            bad = await request(session, f"{spec_server.url}/v1/{endpoint}", body, timeout_s=60)
            good = await request(session, f"{spec_server.url}/v1/completions",
                                 {"model": soak.SERVED_NAME, "prompt": "1, 2, 3,", "max_tokens": 4,
                                  "temperature": 0}, timeout_s=60)
        return bad, good

    bad, good = asyncio.run(go())
    assert bad.status is not None and 400 <= bad.status < 500, (bad.status, bad.body)
    assert good.ok and good.finish_reason, (good.status, good.body)
    assert spec_server.alive()


def test_malformed_json_body_gets_4xx(spec_server):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{spec_server.url}/v1/completions", data=b'{"prompt": "hi", ',
                                 headers={"Content-Type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert 400 <= info.value.code < 500
    assert spec_server.healthy()


def test_openai_client_chats_with_graft_and_metrics_count_drafts(spec_server):
    import urllib.request

    from openai import OpenAI

    client = OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", timeout=120, max_retries=0)
    reply = client.chat.completions.create(
        model=soak.SERVED_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    with urllib.request.urlopen(f"{spec_server.url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert "vllm:spec_decode_num_drafts" in metrics


def test_soak_greedy_identical_to_no_speculation(smollm2, soak_run, spec_server):
    requests, report, replies = soak_run
    spec_server.stop()  # one engine at a time on this machine
    with ServerProcess(smollm2, None, _args(), env=SERVER_ENV) as baseline:
        reference = soak.replay_greedy(baseline, requests, CONCURRENCY)
    soak.compare_greedy(requests, replies, reference, report)
    print("\nsoak:", report.summary())
    assert report.greedy_compared >= SOAK_REQUESTS // 3
    assert report.mismatches == []


@pytest.mark.parametrize("spec,needle", [
    ({"method": "suffix_treee"}, "'suffix_treee' is not a known method"),
    ({"method": "ngram_tree", "max_depth": "8"}, "field 'max_depth': Expected `int`, got `str`"),
])
def test_bad_config_server_exits_nonzero_naming_the_field(tmp_path, spec, needle):
    from vllm_treespec.tools.models import ensure_tiny_llama

    server = ServerProcess(str(ensure_tiny_llama()), spec, ["--enforce-eager"], log_path=tmp_path / "serve.log",
                           startup_timeout_s=300)
    with pytest.raises(ServerStartError) as info:
        server.start()
    assert info.value.returncode not in (None, 0)
    assert needle in info.value.log_tail


@pytest.mark.slow  # ~4 min: the corrupt file is only detected in the worker; scripts/bad_input.py covers it too
def test_corrupt_datastore_fails_startup_naming_the_file(tmp_path):
    from vllm_treespec.tools.models import ensure_tiny_llama

    corrupt = tmp_path / "corpus.vtds"
    corrupt.write_bytes(b"not a datastore" * 10)
    server = ServerProcess(str(ensure_tiny_llama()), {"method": "suffix_tree", "datastore": str(corrupt)},
                           ["--enforce-eager"], log_path=tmp_path / "serve.log", startup_timeout_s=300)
    with pytest.raises(ServerStartError) as info:
        server.start()
    assert info.value.returncode not in (None, 0)
    assert f"datastore '{corrupt}': not a vllm-treespec datastore" in server.log_path.read_text()

"""Engines and prompts for end-to-end tests (fp32: bf16 verification flips near-tie tokens)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

# 1 GiB holds 8 sequences of 1024 tokens of SmolLM2 in fp32 (~0.75 GiB); each engine allocates and zeroes it at start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

HELPERS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(os.path.dirname(HELPERS_DIR))
# Worker processes import test proposers (testing_proposers) and examples by dotted path.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (HELPERS_DIR, REPO_DIR, os.environ.get("PYTHONPATH", "")) if p)


MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# In-process engines share this process's distributed state, and closing one tears it down (vLLM's EngineCore
# shutdown, also run when the engine is garbage-collected): so at most one is alive at a time, and engines that live
# across tests (module fixtures) run multiprocess.
_in_process_alive: list[int] = []


def make_llm(model: str, spec: dict | None = None, *, in_process: bool = True, **kwargs):
    """An engine for a test. ``in_process``: engine core and worker run in the test's process (vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING=0): the same tree path, started in a few seconds instead of ~25 s; close it
    (``close``) before the next in-process engine. ``in_process=False``: vLLM's default multiprocess engine."""
    from vllm import LLM, envs

    if in_process and _in_process_alive:
        raise RuntimeError("close the in-process engine of this test before starting another one")
    options = dict(dtype="float32", max_model_len=1024, max_num_seqs=8, enforce_eager=True, seed=0,
                   disable_log_stats=False)
    options.update(kwargs)
    previous = os.environ.get(MULTIPROCESSING_ENV)
    os.environ[MULTIPROCESSING_ENV] = "0" if in_process else "1"
    try:
        llm = LLM(model=model, speculative_config=spec, **options)
    finally:
        if previous is None:
            os.environ.pop(MULTIPROCESSING_ENV)
        else:
            os.environ[MULTIPROCESSING_ENV] = previous
        # an in-process engine core freezes vLLM's environment reads; later engines and servers must see this one
        envs.disable_envs_cache()
    if in_process:
        _in_process_alive.append(id(llm))
    return llm


def close(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the process exit cleans up too
        pass
    if id(llm) in _in_process_alive:
        _in_process_alive.remove(id(llm))
    del llm
    # an in-process engine core moves its start-up objects out of the collector's reach (gc.freeze): hand them back,
    # or every engine closed in this process would keep its KV cache
    gc.unfreeze()
    gc.collect()


def chat_prompts(model: str, limit_mt: int, limit_he: int) -> list[str]:
    from transformers import AutoTokenizer

    from vllm_treespec.tools.data import human_eval, mt_bench

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True) for q in mt_bench()[:limit_mt]]
    prompts += [q["turns"][0] for q in human_eval()[:limit_he]]
    return prompts


def spec_counters(llm) -> dict[str, object]:
    out: dict[str, object] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            out[metric.name.removeprefix("vllm:spec_decode_")] = getattr(metric, "value", None) \
                if hasattr(metric, "value") else getattr(metric, "values", None)
    return out


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def retrieval_kernel_signatures(worker) -> dict[str, int]:
    """For ``LLM.collective_rpc``: compiled signatures of the retrieval store's numba kernels in the worker."""
    from vllm_treespec.retrieval.warmup import kernel_signatures

    return kernel_signatures()


def step_kernel_signatures(worker) -> dict[str, int]:
    """For ``LLM.collective_rpc``: compiled signatures of every numba kernel of the plugin in the worker."""
    from vllm_treespec.retrieval.warmup import kernel_signatures

    return kernel_signatures("vllm_treespec")


def drafter_checkpoint(worker) -> str:
    """For ``LLM.collective_rpc``: the head folder the worker's eagle_tree / kv_aware proposer loaded."""
    return worker.model_runner.drafter.drafter.checkpoint


def run_python(code: str, env_extra: dict[str, str], timeout: int = 400) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a fresh interpreter with extra environment variables."""
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)

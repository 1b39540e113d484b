"""The plugin with real engines: disabled cleanly on an unsupported vLLM; in-process (single-process) engines start
with a tree method."""

from __future__ import annotations

import pytest

from engine_helpers import run_python


@pytest.mark.engine
def test_unsupported_vllm_version_disables_plugin_and_vllm_still_generates():
    from vllm_treespec.tools.models import ensure_tiny_llama

    code = f"""
        from vllm import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM(model={str(ensure_tiny_llama())!r}, dtype="float32", max_model_len=256, enforce_eager=True)
            out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
            print("GENERATED", len(out[0].outputs[0].token_ids))
            try:
                LLM(model={str(ensure_tiny_llama())!r}, speculative_config={{"method": "static_tree"}})
            except Exception as e:
                print("REJECTED", type(e).__name__)
        """
    # in-process (one vLLM import instead of three): the plugin's version check runs in every process that loads it
    result = run_python(code, {"VLLM_TREESPEC_ASSUME_VLLM_VERSION": "0.99.0", "VLLM_CPU_KVCACHE_SPACE": "1",
                               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert "GENERATED 5" in result.stdout, result.stderr[-3000:]
    assert "vllm_treespec is disabled: vLLM 0.99.0 is not supported" in result.stderr
    assert "REJECTED" in result.stdout  # without the plugin vLLM's own validation refuses our method name


@pytest.mark.engine
def test_in_process_engine_runs_a_numba_tree_method():
    """VLLM_ENABLE_V1_MULTIPROCESSING=0: the worker starts in the process that already imported numba (graft's
    config check loads the retrieval store); the engine must start, draft and stay exact (SmolLM2, fp32)."""
    from engine_helpers import chat_prompts

    from vllm_treespec.tools.models import ensure_smollm2

    model = str(ensure_smollm2())
    code = f"""
        from vllm import LLM, SamplingParams
        if __name__ == "__main__":
            params = SamplingParams(temperature=0, max_tokens=48)
            outputs = []
            # no step-cost budget: it may find nothing worth verifying, and this test needs tree steps
            for spec in (None, {{"method": "graft", "num_speculative_tokens": 8, "cost_budget": False}}):
                llm = LLM(model={model!r}, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
                          speculative_config=spec, disable_log_stats=False)
                got = llm.generate({chat_prompts(model, limit_mt=2, limit_he=0)!r}, params, use_tqdm=False)
                outputs.append([list(o.outputs[0].token_ids) for o in got])
                drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
                llm.llm_engine.engine_core.shutdown()
                del llm
            print("IDENTICAL", outputs[0] == outputs[1], "DRAFTS", drafts)
        """
    result = run_python(code, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert "IDENTICAL True" in result.stdout, result.stderr[-3000:]
    assert int(float(result.stdout.split("DRAFTS")[1].split()[0])) > 0  # graft really drafted
    # as trees: the engine without speculation, built first, must not pin the stock attention backend
    log = result.stdout + result.stderr
    assert "tree verification active" in log and "tree verification is off" not in log


@pytest.mark.engine
def test_a_compiled_engine_loads_its_model_from_vllms_compile_cache(tmp_path):
    """vLLM 0.32 saves a compiled CPU model but fails to load it ('finalize_loading') and compiles at every start.
    With the plugin a later start loads it, in a fresh process and again in the same process (our CPU linear's
    ids do not depend on what was built before), and decodes the same tokens as the engine that compiled it."""
    from vllm_treespec.tools.models import ensure_tiny_llama

    code = f"""
        from vllm import LLM, SamplingParams
        if __name__ == "__main__":
            for _ in range(ENGINES):
                llm = LLM(model={str(ensure_tiny_llama())!r}, dtype="float32", max_model_len=256,
                          max_num_batched_tokens=256, max_num_seqs=4, seed=0)
                out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16),
                                   use_tqdm=False)
                print("TOKENS", list(out[0].outputs[0].token_ids))
                llm.llm_engine.engine_core.shutdown()
                del llm
        """
    env = {"VLLM_CACHE_ROOT": str(tmp_path), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    compiled = run_python(code.replace("ENGINES", "1"), env)
    compiled_log = compiled.stdout + compiled.stderr
    assert "saved AOT compiled function" in compiled_log, compiled.stderr[-3000:]
    loaded = run_python(code.replace("ENGINES", "2"), env)
    log = loaded.stdout + loaded.stderr
    assert log.count("Directly load AOT compilation") == 2, loaded.stderr[-3000:]
    assert "Compiling model again" not in log and "saved AOT compiled function" not in log
    tokens = [line for line in (compiled.stdout + loaded.stdout).splitlines() if line.startswith("TOKENS")]
    assert len(tokens) == 3 and len(set(tokens)) == 1

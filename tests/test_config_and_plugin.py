"""Config translation errors, the version gate and patch signatures."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vllm_treespec.config import TreeSpecConfigError, translate

BAD_CONFIGS = [
    ({"method": "grafty"}, ["'grafty'", "Tree methods", "static_tree", "vLLM methods"]),
    ({"method": "static_tree", "bogus": 1}, ["unknown key", "'bogus'", "Valid keys", "branches"]),
    ({"method": "static_tree", "branches": "4"}, ["'branches'", "Expected `int`, got `str`"]),
    ({"method": "static_tree", "branches": 0}, ["'branches'", ">= 1"]),
    ({"method": "static_tree", "num_speculative_tokens": -1}, ["num_speculative_tokens=-1", "[1, 128]"]),
    ({"method": "static_tree", "num_speculative_tokens": 1000}, ["num_speculative_tokens=1000"]),
    ({"method": "static_tree", "num_speculative_tokens": "8"}, ["num_speculative_tokens='8'"]),
    ({"method": "oracle_tree"}, ["reference_path"]),
    ({"method": "oracle_tree", "reference_path": "/nonexistent/refs.json"}, ["reference_path", "no such file"]),
    ({"method": "nonexistent_pkg.module.Proposer"}, ["nonexistent_pkg.module.Proposer", "importable"]),
    ({"method": "collections.OrderedDict"}, ["collections.OrderedDict", "TreeProposer"]),
    ({"method": 7}, ["method must be a string"]),
]


@pytest.mark.parametrize("spec,needles", BAD_CONFIGS, ids=[str(c[0])[:60] for c in BAD_CONFIGS])
def test_bad_config_gives_one_clear_error(spec, needles):
    with pytest.raises(TreeSpecConfigError) as info:
        translate(spec, None)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message


def test_translation_moves_options_and_keeps_vllm_keys():
    spec, extra, is_tree = translate({"method": "static_tree", "num_speculative_tokens": 12, "branches": 2,
                                      "enforce_eager": True}, {"other": 1})
    assert is_tree
    assert spec == {"method": "custom_class", "model": "vllm_treespec.proposers.static_tree.StaticTreeProposer",
                    "num_speculative_tokens": 12, "enforce_eager": True}
    assert extra["other"] == 1
    assert extra["vllm_treespec"]["options"] == {"branches": 2, "depth": 4}


def test_vllm_methods_pass_through_and_dotted_paths_select_tree_mode():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    assert translate(dict(spec), None) == (spec, None, False)
    path = "vllm_treespec.proposers.static_tree.StaticTreeProposer"
    for given in ({"method": path}, {"model": path, "num_speculative_tokens": 4},
                  {"method": "custom_class", "model": path, "num_speculative_tokens": 4}):
        new, _, is_tree = translate(given, None)
        assert is_tree and new["model"] == path and new["method"] == "custom_class"


def test_patch_signatures_match_installed_vllm():
    from vllm_treespec.patches import EXPECTED_SIGNATURES, check_signatures, engine_args, model_runner
    from vllm_treespec.patches import rejection_sampler, topk_topp_sampler, triton_dispatcher

    engine_args.apply()
    model_runner.apply()
    rejection_sampler.apply()
    topk_topp_sampler.apply()
    triton_dispatcher.apply()
    assert len(EXPECTED_SIGNATURES) == 11
    assert check_signatures() == []


def test_changed_signature_fails_loudly():
    from vllm_treespec.patches import PatchError, wrap_method

    class Target:
        def method(self, a, b):
            return a + b

    with pytest.raises(PatchError, match="expects"):
        wrap_method(Target, "method", ("self", "a"))(lambda original, self, a: original(self, a, 0))


def _run(code: str, env_extra: dict[str, str], timeout: int = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.engine
def test_unsupported_vllm_version_disables_plugin_and_vllm_still_generates():
    from vllm_treespec.models import ensure_tiny_llama

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
    result = _run(code, {"VLLM_TREESPEC_ASSUME_VLLM_VERSION": "0.99.0", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert "GENERATED 5" in result.stdout, result.stderr[-3000:]
    assert "vllm_treespec is disabled: vLLM 0.99.0 is not supported" in result.stderr
    assert "REJECTED" in result.stdout  # without the plugin vLLM's own validation refuses our method name


def test_plugin_register_is_idempotent_and_cheap():
    result = _run("""
        import sys, time
        t = time.perf_counter()
        from vllm_treespec import plugin
        plugin.register(); plugin.register()
        print("ENABLED", plugin.is_enabled(), "TREE", plugin._state["tree_mode"])
        print("RUNNER_IMPORTED", "vllm.v1.worker.gpu_model_runner" in sys.modules)
        """, {"VLLM_TREESPEC_TREE_MODE": "0"})
    assert "ENABLED True TREE False" in result.stdout, result.stderr[-2000:]
    assert "RUNNER_IMPORTED False" in result.stdout


def test_cpu_expand_fix_matches_reference_for_all_dtypes():
    """vLLM's CPU expand kernel leaves float32/int32 outputs uninitialised; our replacement must be exact."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    from vllm_treespec.patches import rejection_sampler

    rejection_sampler.apply()
    for dtype in (torch.int32, torch.int64, torch.float32):
        x = torch.tensor([4, 0, 7, 2], dtype=dtype)
        cu = torch.tensor([3, 3, 5, 6], dtype=torch.int32)
        out = rs.expand_batch_to_tokens(x, cu, 6, replace_from=0, replace_to=1)
        assert out.tolist() == [4, 4, 4, 7, 7, 2] and out.dtype == dtype


def test_tensor_parallel_tree_mode_is_rejected_clearly():
    from types import SimpleNamespace

    from vllm_treespec.config import check_parallelism

    check_parallelism(SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    with pytest.raises(TreeSpecConfigError, match="tensor_parallel_size=1"):
        check_parallelism(SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1))


def test_cpu_kernel_rebind_survives_llvmlite_imported():
    """vLLM's CPU kernel-override scan crashes on llvmlite's ffi.lib (imported with numba); the patch hides it."""
    import types

    import numba  # noqa: F401 - imports llvmlite.binding, whose ffi.lib vLLM's scan cannot read
    from llvmlite.binding import ffi
    from vllm.triton_utils import dispatcher

    from vllm_treespec.patches import ORIGINALS, triton_dispatcher

    triton_dispatcher.apply()
    original = ORIGINALS[(dispatcher, "_rebind_kernels")]
    assert (ffi, "lib", ffi.lib) in [(m, n, v) for m, n, v in triton_dispatcher.unscannable_attributes()]
    with pytest.raises(AttributeError, match="get"):
        original([])  # vLLM's own scan, unpatched
    kernel, wrapper, lib = object(), object(), ffi.lib
    holder = types.ModuleType("treespec_kernel_holder")
    holder.kernel_copy = kernel
    sys.modules[holder.__name__] = holder
    try:
        dispatcher._rebind_kernels([(kernel, wrapper)])
    finally:
        del sys.modules[holder.__name__]
    assert holder.kernel_copy is wrapper  # the scan still rebinds kernels
    assert ffi.lib is lib  # and the hidden attribute is back


@pytest.mark.engine
def test_in_process_engine_runs_a_numba_tree_method():
    """VLLM_ENABLE_V1_MULTIPROCESSING=0: the worker starts in the process that already imported numba (graft's
    config check loads the retrieval store); the engine must start, draft and stay exact (SmolLM2, fp32)."""
    from engine_helpers import chat_prompts

    from vllm_treespec.models import ensure_smollm2

    model = str(ensure_smollm2())
    code = f"""
        from vllm import LLM, SamplingParams
        if __name__ == "__main__":
            params = SamplingParams(temperature=0, max_tokens=48)
            outputs = []
            for spec in (None, {{"method": "graft", "num_speculative_tokens": 8}}):
                llm = LLM(model={model!r}, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
                          speculative_config=spec, disable_log_stats=False)
                got = llm.generate({chat_prompts(model, limit_mt=2, limit_he=0)!r}, params, use_tqdm=False)
                outputs.append([list(o.outputs[0].token_ids) for o in got])
                drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
                llm.llm_engine.engine_core.shutdown()
                del llm
            print("IDENTICAL", outputs[0] == outputs[1], "DRAFTS", drafts)
        """
    result = _run(code, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert "IDENTICAL True" in result.stdout, result.stderr[-3000:]
    assert int(float(result.stdout.split("DRAFTS")[1].split()[0])) > 0  # graft really drafted

"""Config translation errors, the version gate and patch signatures."""

from __future__ import annotations

import sys

import pytest

from engine_helpers import run_python
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
    from vllm_treespec.attn import flash  # noqa: F401 - records the FlashAttention methods it overrides
    from vllm_treespec.patches import (compile_cache, cpu_gemm, cpu_worker, cudagraph_dispatcher, draft_delivery,
                                       forward_times, gpu_worker, rejection_sampler, topk_topp_sampler,
                                       triton_dispatcher)
    from vllm_treespec.plugin import activate_tree_mode

    engine_args.apply(activate_tree_mode)
    model_runner.apply()
    rejection_sampler.apply()
    topk_topp_sampler.apply()
    triton_dispatcher.apply()
    cudagraph_dispatcher.apply()  # CUDA only; its signature is recorded on every platform
    cpu_worker.apply()
    gpu_worker.apply()  # the warm-up on GPUs only (its signature is recorded on every platform), shutdown everywhere
    draft_delivery.apply()
    cpu_gemm.apply()
    compile_cache.install()
    forward_times.install()  # only where a benchmark sets VLLM_TREESPEC_FORWARD_TIMES; its signature checked always
    assert len(EXPECTED_SIGNATURES) == 25
    assert check_signatures() == []


def test_changed_signature_fails_loudly():
    from vllm_treespec.patches import PatchError, wrap_method

    class Target:
        def method(self, a, b):
            return a + b

    with pytest.raises(PatchError, match="expects"):
        wrap_method(Target, "method", ("self", "a"))(lambda original, self, a: original(self, a, 0))


def test_plugin_register_is_idempotent_and_cheap():
    result = run_python("""
        import sys, time
        t = time.perf_counter()
        from vllm_treespec import plugin
        plugin.register(); plugin.register()
        print("ENABLED", plugin.is_enabled(), "TREE", plugin._state["tree_mode"])
        print("RUNNER_IMPORTED", "vllm.v1.worker.gpu_model_runner" in sys.modules)
        from vllm.triton_utils import dispatcher
        from vllm_treespec.patches import is_patched
        print("REBIND_PATCHED", is_patched(dispatcher, "_rebind_kernels"))
        """, {"VLLM_TREESPEC_TREE_MODE": "0"})
    assert "ENABLED True TREE False" in result.stdout, result.stderr[-2000:]
    assert "RUNNER_IMPORTED False" in result.stdout
    # every CPU engine, speculative or not, gets the kernel scan's fix: this package imports numba (llvmlite), and
    # an in-process plain engine's worker would crash in vLLM's scan without it
    assert "REBIND_PATCHED True" in result.stdout


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


def test_tree_backend_replaces_a_backend_resolved_earlier_in_the_process():
    """In-process engines: an engine without a tree method resolves (and vLLM memoizes) the stock CPU backend; once
    tree mode registers the override, the next resolution must give the tree backend, not the memo."""
    result = run_python("""
        import torch
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend
        from vllm_treespec.attn import register_backends

        with set_current_vllm_config(VllmConfig()):
            before = get_attn_backend(64, torch.float32, "auto").__name__
            register_backends()
            after = get_attn_backend(64, torch.float32, "auto").__name__
        print("BACKENDS", before, after)
        """, {"VLLM_TREESPEC_TREE_MODE": "0"})
    assert "BACKENDS CPUAttentionBackend TreeCPUAttentionBackend" in result.stdout, result.stderr[-3000:]

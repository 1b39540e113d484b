"""The patches that let a compiled CPU engine load its model from vLLM's compile cache (no engine; the engine test
is tests/engine/test_plugin_engine.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_treespec.cpu_gemm import NumbaLinear
from vllm_treespec.patches import compile_cache


class _Layer(torch.nn.Module):
    def __init__(self, weight: torch.Tensor | None, ours: bool) -> None:
        super().__init__()
        self.cpu_linear = NumbaLinear(weight) if ours else (lambda x, w, b: x @ w.T)


class _Model(torch.nn.Module):
    def __init__(self, weights: list[torch.Tensor], ours: list[bool]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(w, o) for w, o in zip(weights, ours)])

    def forward(self, x):
        return x


def _weights(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 24, generator=generator) * 0.1).to(torch.bfloat16) for _ in range(3)]


def test_the_cache_key_names_every_layers_linear_and_is_vllms_without_ours():
    weights = _weights()
    key = compile_cache.linear_digest(_Model(weights, [True, True, False]))
    assert key == compile_cache.linear_digest(_Model([w.clone() for w in weights], [True, True, False]))
    assert key != compile_cache.linear_digest(_Model(weights, [True, False, False]))  # another choice
    assert key != compile_cache.linear_digest(_Model(weights, [True, True, True]))
    changed = [w.clone() for w in weights]
    changed[1][0, 0] += 1
    assert key != compile_cache.linear_digest(_Model(changed, [True, True, False]))  # other weights
    assert compile_cache.linear_digest(_Model(weights, [False, False, False])) is None
    assert compile_cache.linear_digest(None) is None

    def vllms_key(fn):
        return "vllm-key"

    model = _Model(weights, [True, True, False])
    assert compile_cache.model_hash_key(vllms_key, model.forward) == f"vllm-key vllm_treespec-cpu-linears {key}"
    assert compile_cache.model_hash_key(vllms_key, _Model(weights, [False] * 3).forward) == "vllm-key"
    assert compile_cache.model_hash_key(vllms_key, len) == "vllm-key"  # not a module's method: vLLM's key


def test_an_inductor_artifact_is_finalized_as_loaded_only_during_vllms_load():
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as bundled

    if hasattr(bundled, "finalize_loading"):
        pytest.skip("this torch's inductor artifact has finalize_loading: nothing to lend")
    seen = []

    def vllms_load(model, aot_compilation_path):
        seen.append((model, aot_compilation_path, bundled.finalize_loading(object(), None)))
        return "loaded"

    assert compile_cache.load_aot_compiled(vllms_load, "model", "/cache/model") == "loaded"
    assert seen == [("model", "/cache/model", None)]
    assert not hasattr(bundled, "finalize_loading")

    def failing_load(model, aot_compilation_path):
        raise RuntimeError("corrupt artifact")

    with pytest.raises(RuntimeError, match="corrupt"):
        compile_cache.load_aot_compiled(failing_load, "model", "/cache/model")
    assert not hasattr(bundled, "finalize_loading")

"""Defaults that depend on the device the target runs on, in one place: :func:`device_kind` names the key ("cpu" or
"other": GPUs and other accelerators) and every table below is keyed by it. The numbers were measured on 2 CPU cores
(SmolLM2-135M); the comments say where each comes from. An option a user sets always wins over these.

They are fallbacks: an engine with its measured step-cost budget (``"cost_budget"``, on by default: vllm_treespec.cost)
sizes trees, floors nodes and gates graft's head from its own measurements instead, and uses these tables only when
no cost model could be built or the budget is switched off. (eagle_tree and kv_aware still apply the confidence floor
while their head expands.)"""

from __future__ import annotations

from typing import Any

#: path confidence below which a draft node is not verified, by device. On 2 CPU cores a verified token costs ~2.4 ms
#: of a ~50 ms step, worth it only for nodes accepted about 1 time in 20 (graft: scripts/bench_graft.py
#: --confidence-floors, on the head 24.9 -> 27.0 tok/s at 0.05, 26.2 at 0.15; retrieval-only 25.8 / 26.0 / 25.8;
#: eagle_tree 16 0.80x -> 1.05x no speculation at 0.05). GPUs verify hundreds of tokens at the cost of one.
#: Shared by eagle_tree, kv_aware and graft.
DEFAULT_MIN_NODE_CONFIDENCE = {"cpu": 0.05, "other": 0.0}
#: graft: tokens per verify forward below which a step costs about one decode step, when not calibrated (GPUs stay
#: flat for hundreds of tokens)
DEFAULT_KNEE_TOKENS = {"cpu": 16, "other": 512}
#: graft: CPU budget by batch size when not calibrated. On 2 cores a forward is already compute-bound at a few tokens
#: (the no-speculation server's time per output token at concurrency 1/4/8/16: 50/48/60/83 ms for 1/4/8/16 tokens per
#: step), so a hinge at 16 tokens gave batches of 4 three nodes each and lost 15% to no speculation
#: (`vllm-treespec bench serve`, README). Full budget alone, 3 nodes each for two requests, none from four.
DEFAULT_CPU_BUDGET_TABLE = {1: 128, 2: 3, 4: 0}
#: graft: largest batch for which the model drafter (EAGLE head) drafts, by device; larger batches get retrieval-only
#: trees. On 2 CPU cores the head's levels cost more than they win once requests share the step (`bench serve`,
#: README: at concurrency 2 the head at every batch 31.0 tok/s = 0.96x, at batch 1 only 43.7 = 1.35x); GPUs draft for
#: any batch.
DEFAULT_MODEL_DRAFT_MAX_BATCH = {"cpu": 1, "other": 1 << 30}


def device_kind(vllm_config: Any) -> str:
    """Key of the per-device defaults: "cpu" or "other" (GPUs and other accelerators)."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
    return "cpu" if device == "cpu" else "other"


def device_name() -> str:
    """The accelerator's name, or on CPU the processor's model name with torch's CPU capability (AVX2, AVX512…):
    the bf16 GEMM path depends on it."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return current_platform.get_device_name()
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if not name:
        import platform

        name = platform.processor() or platform.machine()
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"

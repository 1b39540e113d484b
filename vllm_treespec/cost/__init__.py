"""What a verify step costs, and which draft nodes are worth it.

* :mod:`vllm_treespec.cost.model` — the step-cost model (forward seconds as a function of the step's tokens and
  requests), fitted on measured points, refined online from observed step times, cached on disk. numpy + msgspec only;
  its predictions run :mod:`vllm_treespec.cost.fast_predict`'s Numba kernel where Numba is installed.
* :mod:`vllm_treespec.cost.measure` — the start-up sweep that measures it inside a worker on the real model.
* :mod:`vllm_treespec.cost.allocate` — the batch-wide node budget (ECHO): admit draft nodes best-first by path
  acceptance probability while they raise the expected tokens per second.
* :mod:`vllm_treespec.cost.budget` — the engine side: one budget per verifier, its drafter gate and online timing.
* :mod:`vllm_treespec.cost.trace` — ``VLLM_TREESPEC_BUDGET_TRACE``: the budget's decisions, one JSON line per step.
"""

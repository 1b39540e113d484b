"""Tree speculative decoding for stock vLLM, as a plugin (``vllm.general_plugins`` → :func:`vllm_treespec.plugin.register`).

Inside vLLM: :mod:`.api` (the proposer API), :mod:`.config` and :mod:`.plugin` (process 0), :mod:`.tree`,
:mod:`.verify`, :mod:`.attn`, :mod:`.kv_view`, :mod:`.patches` (workers), :mod:`.eagle` (draft heads) and the
proposers in :mod:`.proposers`, over the standalone :mod:`.retrieval` store. Outside it: :mod:`.tools` (CLI, benchmarks,
demo, server harness) and :mod:`.training` (the head trainer). Importing this package imports nothing else.
"""

"""EAGLE-3 and KV-aware draft heads as a vLLM worker runs them (:mod:`.model`, :mod:`.kv_head`), and the EAGLE-2 tree
drafter that runs them inside the proposers (:mod:`.drafter`). Checkpoints are in the format vLLM's ``eagle3`` method
loads; the trainer is :mod:`vllm_treespec.training`."""

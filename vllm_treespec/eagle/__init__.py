"""EAGLE-3 draft heads: the head itself (:mod:`.model`), the training data pipeline (:mod:`.data`) and the trainer
(:mod:`.train`, ``vllm-treespec train-eagle``). Checkpoints are written in the format vLLM's ``eagle3`` method loads."""

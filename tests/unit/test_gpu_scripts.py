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
    # the same tables from the record alone, measuring nothing (no interpreter, no GPU)
    again = subprocess.run([sys.executable, "scripts/gpu_step_cost.py", "--report",
                            str(tmp_path / "cost-smoke-float32-eager.json")], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr[-4000:]
    tables = again.stdout
    assert "allocator on this curve" in tables and "held out" not in tables
    assert out.split("allocator on this curve")[1] == tables.split("allocator on this curve")[1]


def test_gpu_kernel_tuning_ranks_every_configuration():
    """--tune needs a GPU; its loop, its compiling processes and its ranking run here under the interpreter on two
    tiny shapes."""
    code = """
import sys, torch
sys.path.insert(0, "scripts")
import bench_gpu_tree_attention as bench
from vllm_treespec.attn import triton_tree
bench.TUNE_SHAPES = ((1, 40, 4), (2, 20, 8))
bench.TUNE_TILE_M, bench.TUNE_BLOCK_N, bench.TUNE_WARPS, bench.TUNE_STAGES = (32, 64), (64,), (4,), (3,)
torch.cuda.get_device_name = lambda *a: "interpreter"
torch.cuda.empty_cache = lambda: None
bench.tune(triton_tree, torch.device("cpu"), 4, 2, 16, 16, torch.float32, 1, jobs=2)
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert "compiled 2 configurations x 2 shapes in 2 processes" in proc.stdout
    assert sum(line.startswith("1x40x4: defaults (64, 64, 4, 3)") for line in lines) == 1
    ranked = [line for line in lines if line.startswith("| 32 |") or line.startswith("| 64 |")]
    means = [float(line.rstrip(" |").rsplit("|", 1)[1]) for line in ranked]
    assert len(means) == 2 and means == sorted(means) and means[0] >= 1.0  # best first, relative to each shape's best

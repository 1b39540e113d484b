"""scripts/step_split.py's profile listing: only this project's functions, in ms per engine step."""

from __future__ import annotations

import cProfile

from script_helpers import load_script

from vllm_treespec.api import DraftTree


def test_the_profile_lists_this_projects_functions_per_engine_step(capsys):
    script = load_script("step_split")
    profiler = cProfile.Profile()
    DraftTree([1], [-1])  # its check's module imported and compiled before the profile, as in a running engine
    profiler.enable()
    for _ in range(50):
        DraftTree([1, 2, 3], [-1, 0, 1], [0.5, 0.5, 0.5]).depths()
        sorted(range(100))  # a builtin: not this project's, never listed
    profiler.disable()
    script.print_own_profile(profiler, steps=10, count=5)
    out = capsys.readouterr().out
    assert "by own time" in out and "by inclusive" in out
    listed = [line for line in out.splitlines() if line.startswith("    ")]
    # DraftTree's own functions and the compiled check it calls (vllm_treespec/tree_checks.py)
    assert listed and all(any(name in line for name in ("api.py", "tree.py", "tree_checks.py")) for line in listed), out
    depths = next(line for line in listed if "(depths)" in line)
    assert int(depths.split()[1]) == 50  # calls; the first column is ms per step

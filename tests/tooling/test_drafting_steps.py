"""scripts/drafting_steps.py on made-up traces: a bench serve folder's levels and rounds, cut by the windows its
results.json keeps, and a folder of traces alone."""

from __future__ import annotations

import argparse
import json

import pytest
from script_helpers import load_script

drafting_steps = load_script("drafting_steps")


def write_trace(path, start, head):
    steps = [{"t": start, "reqs": 4, "tokens": 4, "drafts": 0},
             {"t": start + 0.05, "reqs": 4, "tokens": 8, "drafts": 4, "accepted": 2, "drafter_ms": 3.0,
              "expected": 6.0, "best": 100.0, "plain": 100.0, **({"head_ms": 5.0} if head else {})},
             {"t": start + 0.12, "reqs": 4, "tokens": 4, "drafts": 0}]
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))


def test_it_splits_a_served_runs_drafting_steps_by_level_and_round(tmp_path, capsys):
    write_trace(tmp_path / "budget-graft-r1.jsonl.101", 100.0, head=True)
    write_trace(tmp_path / "budget-graft-r2.jsonl.202", 200.0, head=False)
    (tmp_path / "budget-graft-r1.jsonl.101.cost.json").write_text("{}")  # the worker's record: not a trace
    results = {"methods": [{"label": "graft", "round_numbers": [1, 2],
                            "levels": {"8": {"rounds_window": [[99.0, 101.0], [199.0, 201.0]]}}},
                           {"label": "none", "round_numbers": [1, 2],
                            "levels": {"8": {"rounds_window": [[99.0, 101.0], [199.0, 201.0]]}}}]}
    (tmp_path / "results.json").write_text(json.dumps(results))
    drafting_steps.main([str(tmp_path), "--requests", "3-8"])
    out = capsys.readouterr().out.splitlines()
    assert out == ["graft at 8 requests, round 1: self-gated: 1 steps, 78.0 ms (priced 60.0), vs plain 0.769",
                   "graft at 8 requests, round 2: rest: 1 steps, 73.0 ms (priced 60.0), vs plain 0.822"]
    drafting_steps.main([str(tmp_path), "--requests", "9-"])
    assert capsys.readouterr().out.splitlines()[0] == "graft at 8 requests, round 1: no drafting step"


def test_it_reads_a_folder_of_traces_whole_and_says_when_there_is_none(tmp_path, capsys):
    write_trace(tmp_path / "budget-graft-r1.jsonl.7", 5.0, head=False)
    drafting_steps.main([str(tmp_path)])
    assert capsys.readouterr().out.strip() == \
        "budget-graft-r1.jsonl: rest: 1 steps, 73.0 ms (priced 60.0), vs plain 0.822"
    with pytest.raises(SystemExit, match="no budget trace"):
        drafting_steps.main([str(tmp_path / "empty")])


@pytest.mark.parametrize("text, expected", [("5-8", (5, 8)), ("9-", (9, None)), ("4", (4, 4))])
def test_request_ranges(text, expected):
    assert drafting_steps.request_range(text) == expected


def test_a_bad_request_range_names_the_option_and_the_form():
    with pytest.raises(argparse.ArgumentTypeError, match=r"--requests '5\.\.8': give N, N-M or N-"):
        drafting_steps.request_range("5..8")

"""The benchmark keeps working: its quick mode runs every scenario against real Gunicorn."""

import json
import subprocess
import sys

from harness import REPO

SCENARIOS = [
    "scenario_1_short_prompt",
    "scenario_2_system_prompt",
    "scenario_3_concurrency",
    "scenario_4_cache_hit",
    "scenario_5_memory",
    "scenario_6_cold_start",
    "scenario_7_matrix",
]


def test_quick_benchmark_writes_every_scenario_without_errors(tiny_model_dir, tmp_path):
    """Run `bench/run.py --quick` and check both results files hold every scenario, error-free."""
    subprocess.run(
        [sys.executable, "bench/run.py", "--quick", "--model-dir", str(tiny_model_dir), "--results-dir", str(tmp_path),
         "--name", "ci"],
        cwd=REPO, check=True, timeout=900, capture_output=True,
    )
    results = json.loads((tmp_path / "ci.json").read_text())
    assert [name for name in SCENARIOS if name not in results] == []
    assert {"baseline", "bound", "ratios"} <= results.keys()
    assert set(results["scenario_3_concurrency"]) == {"1", "2", "4", "5", "8"}
    assert all(not row["errors"] for row in results["scenario_3_concurrency"].values())
    assert results["scenario_1_short_prompt"]["errors"] == []
    assert results["scenario_1_short_prompt"]["completion_tokens"] > 0
    assert results["scenario_5_memory"]["processes"] == results["scenario_6_cold_start"]["workers"] + 1
    table = (tmp_path / "ci.md").read_text()
    for number in range(1, 8):
        assert f"| {number}. " in table


def test_quick_conversations_benchmark_runs_both_scenarios_without_errors(tmp_path):
    """Run `bench/conversations.py --quick --no-peer`: every turn timed, reuse measured, both tables written."""
    subprocess.run(
        [sys.executable, "bench/conversations.py", "--quick", "--no-peer", "--results-dir", str(tmp_path),
         "--name", "ci"],
        cwd=REPO, check=True, timeout=900, capture_output=True,
    )
    (figures,) = json.loads((tmp_path / "ci.json").read_text())["rounds"]
    multi_turn = figures["corechat"]["multi_turn"]
    assert multi_turn["errors"] == [] and len(multi_turn["first_token_seconds_by_turn"]) == 3
    assert all(seconds > 0 for seconds in multi_turn["first_token_seconds_by_turn"])
    assert 0 < multi_turn["reuse_of_previous_turn"] <= 1
    behind = figures["corechat_one_worker"]["short_behind_long"]
    assert behind["errors"] == [] and behind["short_first_token_seconds"] > 0
    table = (tmp_path / "ci.md").read_text()
    assert "## Multi-turn" in table and "## A one-line question" in table

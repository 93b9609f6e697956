"""The recipe `recipes/agent.py`: argument handling, the summary, and a short real run as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from recipe_helpers import ROOT, load_recipe, run

RECIPE = ROOT / "recipes" / "agent.py"


@pytest.fixture(scope="module")
def recipe():
    yield from load_recipe(RECIPE, "trl_dta_recipe_agent")


def _summary(result: subprocess.CompletedProcess) -> dict:
    """The JSON of the recipe's last line, `summary: {...}`."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("summary: "), result.stdout[-3000:]
    return json.loads(last.removeprefix("summary: "))


def test_default_config_applies_only_to_the_embedded_setup(recipe):
    script_args, training_args, model_args = recipe.parse_args([])
    assert model_args.model_name_or_path is None
    assert training_args.dta_sample_layout == "per_turn" and training_args.use_cpu and not training_args.bf16
    assert script_args.agent_max_turns == 3 and training_args.max_completion_length == 12
    _, training_args, _ = recipe.parse_args(["--dta_sample_layout", "episode", "--max_steps", "7"])
    assert training_args.dta_sample_layout == "episode" and training_args.max_steps == 7
    _, training_args, model_args = recipe.parse_args(["--model_name_or_path", "Qwen/Qwen2.5-0.5B", "--use_cpu"])
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-0.5B"
    assert training_args.learning_rate == 1e-6 and training_args.dta_sample_layout == "episode"  # TRL's defaults


def test_summary_reads_the_logged_metrics(recipe):
    logs = [{"reward": r, "dta/compression_ratio": 8.0, "dta/compression_ratio_micro_batch": 5.0,
             "dta/tokens": 4000.0, "dta/tree_tokens": 500.0, "dta/forward_tokens": 520.0}
            for r in (0.1, 0.2, 0.3, 0.5, 0.6, 0.7)] + [{"train_runtime": 1.0}]
    summary = recipe.summarize(logs, steps=6, wall_time=12.04, window=2, layout="per_turn", num_processes=2)
    assert summary == {"steps": 6, "processes": 2, "layout": "per_turn", "wall_s": 12.0,
                       "reward_first": pytest.approx(0.15), "reward_last": pytest.approx(0.65),
                       "compression_ratio": 8.0, "compression_ratio_micro_batch": 5.0, "tokens": 4000.0,
                       "tree_tokens": 500.0, "forward_tokens": 520.0}
    dense = recipe.summarize([{"reward": 0.1}, {"reward": 0.2}], steps=2, wall_time=1.0, window=5, layout="episode")
    assert dense["reward_first"] == 0.1 and dense["reward_last"] == 0.2 and dense["compression_ratio"] is None


def test_shortrun(tmp_path):
    out = tmp_path / "run"
    result = run([sys.executable, str(RECIPE), "--max_steps", "2", "--output_dir", str(out)])
    summary = _summary(result)
    assert summary["steps"] == 2 and summary["layout"] == "per_turn" and summary["processes"] == 1
    assert 0.0 <= summary["reward_first"] <= 1.0 and 0.0 <= summary["reward_last"] <= 1.0
    # Per-turn rows of 3-turn episodes sharing a ~600-token system prompt: the step's forest is deep.
    assert summary["compression_ratio"] > summary["compression_ratio_micro_batch"] > 4.0
    assert summary["tree_tokens"] * summary["compression_ratio"] == pytest.approx(summary["tokens"], rel=0.2)
    assert (out / "initial_model" / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()

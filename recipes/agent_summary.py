"""The console output of `recipes/agent.py`: what the run prints before training ([`describe`]) and its summary from
the trainer's logged metrics ([`summarize`], [`format_summary`])."""

from __future__ import annotations

import resource

from trl_dta.analysis.run_summary import mean_of, reward_trend


def describe(info: dict, training_args, reward_funcs: list) -> str:
    """The lines the run prints before training: domain, tasks, prompt, tools, budget, rewards."""
    lines = [f"domain: {info['domain']}    task split: {info['task_split'] or 'all'} ({info['num_tasks']} tasks)",
             f"system prompt: {info['system_prompt_tokens']} tokens shared by every episode (policy "
             f"{info['policy_chars']} characters, {info['tools']} tools); prompts {info['prompt_tokens'][0]}-"
             f"{info['prompt_tokens'][1]} tokens",
             f"episode budget: {info['max_tokens']} tokens" + (f" = {info['max_tokens_rule']}" if "max_tokens_rule"
                                                                 in info else " (--agent_max_tokens)")
             + f", at most {training_args.max_completion_length} per turn",
             f"rewards ({info['reward']}): " + ", ".join(f.__name__ for f in reward_funcs)
             + (f", weights {training_args.reward_weights}" if training_args.reward_weights else "")]
    return "\n".join(lines)


# The step's split: summary key -> logged metric (seconds per optimizer step, means over logged steps).
STEP_SPLIT = {"step_s": "step_time", "generation_s": "dta/rollout_generation_s", "env_s": "dta/rollout_env_s",
              "reward_s": "dta/rollout_reward_s", "dta_train_s": "dta/step_time"}


def summarize(log_history: list[dict], steps: int, wall_time: float, window: int, layout: str,
              num_processes: int = 1, info: dict | None = None, generation: str = "transformers") -> dict:
    """The run's summary from the trainer's logged metrics.

    Args:
        log_history (`list[dict]`): `trainer.state.log_history`.
        steps (`int`): optimizer steps taken.
        wall_time (`float`): seconds of `trainer.train()`.
        window (`int`): number of first and last logged steps whose rewards are compared.
        layout (`str`): the training layout, `dta_sample_layout`.
        num_processes (`int`, *optional*, defaults to `1`): processes of the run (the token counts are this
            process's).
        info (`dict`, *optional*): the workload's (`Workload.info`): domain, tasks, system prompt, tools, budget.
        generation (`str`, *optional*, defaults to `"transformers"`): what sampled the rollouts: `"vllm"`
            (`use_vllm=True`) or `"transformers"`.

    Returns:
        `dict`: `steps`, `processes`, `layout`, `wall_s`, `reward_first`, `reward_last` (means over the first and last
        `window` logged steps, at most half of them each), `rewards` (the same per reward function), `entropy`
        (`[first, last]`, TRL's logged policy entropy), `rewards_steps`
        (logged steps), `frac_reward_zero_std` (mean over logged steps: the share of groups without a learning
        signal), `compression_ratio` (the step forests', mean over logged steps), `compression_ratio_micro_batch`,
        `tokens` and `tree_tokens` (per forest), `forward_tokens`, `rollout_tokens`, `rollout_forward_tokens` and
        `rollout_cached_tokens` (per rollout; the last with vLLM only), `generation`, the step's split in seconds
        (`STEP_SPLIT`), the workload's `info` keys, `peak_rss_gb`. Values a run did not log are `None`.
    """
    logs = [entry for entry in log_history if "reward" in entry]
    summary = {
        "generation": generation,
        "steps": steps,
        "processes": num_processes,
        "layout": layout,
        "wall_s": round(wall_time, 1),
        **reward_trend(log_history, window),
        "frac_reward_zero_std": mean_of(logs, "frac_reward_zero_std"),
    }
    for key in ("compression_ratio", "compression_ratio_micro_batch", "tokens", "tree_tokens", "forward_tokens",
                "rollout_tokens", "rollout_forward_tokens", "rollout_cached_tokens"):
        summary[key] = mean_of(logs, f"dta/{key}")
    for key, metric in STEP_SPLIT.items():
        summary[key] = mean_of(logs, metric)
    summary.update({key: value for key, value in (info or {}).items() if key != "prompt_tokens"})
    summary["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return summary


def format_summary(summary: dict) -> str:
    """The summary as a readable block (the JSON line follows it)."""
    def num(value, fmt=".3f"):
        return "n/a" if value is None else format(value, fmt)

    lines = ["=" * 26 + " trl-dta agent summary " + "=" * 26,
             f"domain: {summary.get('domain', 'standin')}    layout: {summary['layout']}    steps: {summary['steps']}"
             f"    generation: {summary.get('generation', 'transformers')}"
             f"    processes: {summary['processes']}    wall time: {summary['wall_s']:.1f} s"]
    k = summary["rewards_steps"]
    delta = None if summary["reward_first"] is None else summary["reward_last"] - summary["reward_first"]
    lines.append(f"reward (mean of the first / last {k} logged steps): {num(summary['reward_first'])} -> "
                 f"{num(summary['reward_last'])} ({num(delta, '+.3f')})")
    for name, (first, last) in summary["rewards"].items():
        lines.append(f"  {name}: {num(first)} -> {num(last)}")
    entropy = summary.get("entropy") or [None, None]
    if None not in entropy:
        lines.append(f"entropy (the policy's, nats per trained token): {entropy[0]:.3f} -> {entropy[1]:.3f}")
    lines.append(f"groups without a learning signal (frac_reward_zero_std, mean): "
                 f"{num(summary['frac_reward_zero_std'], '.2f')}")
    split = ", ".join(f"{label} {num(summary[key], '.1f')} s" for label, key in (
        ("generation", "generation_s"), ("tools and users", "env_s"), ("grading", "reward_s"),
        ("DTA training", "dta_train_s")))
    lines.append(f"step: {num(summary['step_s'], '.1f')} s = {split} (+ TRL's bookkeeping)")
    if summary["rollout_tokens"] is not None:
        cached = summary.get("rollout_cached_tokens")
        lines.append(f"rollout: {summary['rollout_tokens']:.0f} episode tokens, "
                     f"{num(summary['rollout_forward_tokens'], '.0f')} forwarded while generating"
                     + ("" if cached is None else f", {cached:.0f} from vLLM's prefix cache"))
    if summary["compression_ratio"] is not None:
        lines.append(f"training forest: {summary['tokens']:.0f} tokens as {summary['tree_tokens']:.0f} tree tokens "
                     f"({summary['compression_ratio']:.1f}x; each micro-batch alone "
                     f"{summary['compression_ratio_micro_batch']:.1f}x)")
    lines.append(f"peak memory (RSS): {summary['peak_rss_gb']:.2f} GB")
    lines.append("=" * 75)
    return "\n".join(lines)

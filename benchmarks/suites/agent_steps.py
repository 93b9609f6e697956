"""The trainer benchmark's agent runs (`bench_trainer --agent`): `DTAGRPOTrainer` on replayed multi-turn episodes,
dense and DTA in the episode and per-turn sample layouts (`workloads/agent.py` builds and replays the episodes), and
`--stats-only`: the tau2 domains' workload numbers without training.
"""

from __future__ import annotations

import os
import tempfile

import torch

from ..harness.cli import log, set_threads
from ..harness.isolation import run_isolated
from ..harness.models import build_model, model_shape, parse_dtype
from ..reporting.plots import plot, plot_tau2_stats
from ..reporting.results import fill_ratios, markdown_table, write_csv
from ..workloads.agent import AGENT_SIZES, ReplayRollout, Tau2Prompts, agent_episodes, agent_forest
from .trainer_steps import bench_config, step_timer

AGENT_LAYOUTS = ("episode", "per_turn")
AGENT_METHODS = ("dense", "dta")


def measure_agent(sizes: dict, layout: str, method: str, shape: str, device: str, dtype: str, steps: int,
                  threads: int | None, seed: int = 0) -> dict:
    """Train `1 + steps` optimizer steps of replayed episodes and time the last `steps` (via `run_isolated`).

    One optimizer step = one generation of `tasks * group` episodes: `per_device_train_batch_size = group`,
    `gradient_accumulation_steps = steps_per_generation = tasks`; the dataset holds the `tasks` tasks, so every step
    trains the same rows (in TRL's shuffled order).
    """
    from trl_dta.envs import build_dataset, episode_reward
    from trl_dta.trainers.grpo import DTAGRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    set_threads(threads)
    domain, tokenizer, episodes = agent_episodes(sizes, seed)
    model = build_model(shape, parse_dtype(dtype) if dtype != "bf16" else torch.float32, device,
                               seed=seed)
    timer = step_timer(device)
    with tempfile.TemporaryDirectory() as out:
        config = bench_config(out, micro_batch_size=sizes["group"], micro_batches=sizes["tasks"], group=sizes["group"],
                              steps=steps, dtype=dtype, device=device, seed=seed, max_completion_length=64,
                              gradient_checkpointing=False,  # both methods keep every graph (the fastest of each)
                              dta_enabled=method == "dta", dta_sample_layout=layout)
        if isinstance(domain, Tau2Prompts):
            from datasets import Dataset

            dataset = Dataset.from_dict({"prompt": [f"tau2 task {i}" for i in dict.fromkeys(e.task_id for e in
                                                                                           episodes)]})
        else:
            dataset = build_dataset(domain, sizes["tasks"])
        trainer = DTAGRPOTrainer(model=model, reward_funcs=episode_reward, args=config, train_dataset=dataset,
                                 processing_class=tokenizer, rollout_func=ReplayRollout(domain, episodes),
                                 callbacks=[timer])
        trainer.train()
        peak = timer.memory.peak_mb()
    # the compression of the forests the engine ran (one per optimizer step, averaged over the run), as logged
    history = trainer.state.log_history
    forests = [entry["dta/compression_ratio"] for entry in history if "dta/compression_ratio" in entry]
    # what TRL's dense path runs: the last generation's padded micro-batches, prompt and completion columns
    padded = sum(batch["prompt_ids"].numel() + batch["completion_ids"].numel() for batch in trainer._buffered_inputs)
    timed = sorted(timer.times[1:])
    forest = agent_forest(episodes, layout, shape)
    return {
        "workload": f"agent-{layout}",
        "method": method,
        **forest,
        "engine_compression": forests[-1] if forests else None,
        "padded_vs_tokens": padded / forest["n_tokens"],
        "turns_per_episode": sum(len(e.turns) for e in episodes) / len(episodes),
        "reward_mean": sum(e.reward.reward for e in episodes) / len(episodes),
        "step_s": timed[0],
        "median_step_s": timed[len(timed) // 2],
        "tokens_per_s": forest["n_tokens"] / timed[0],
        "peak_mem_mb": max(peak, 0.0),
        "model_shape": model_shape(shape).name,
        "device": device,
        "dtype": dtype,
        "loadavg": os.getloadavg()[0],
    }


AGENT_COLUMNS = ("workload", "method", "n_sequences", "n_tokens", "n_tree_tokens", "compression_ratio",
                 "engine_compression", "ideal_ratio", "padded_vs_tokens", "step_s", "speedup_vs_dense",
                 "fraction_of_ideal", "step_vs_dense_episode", "peak_mem_mb", "mem_vs_dense")


def run_agent(args, shape: str, threads: int | None) -> None:
    """`--agent`: dense and DTA in both layouts; writes `benchmarks/results/trainer-agent[-quick]...`."""
    sizes = dict(AGENT_SIZES["quick" if args.quick else "full"])
    sizes.update({k: v for k, v in (("tasks", args.agent_tasks), ("group", args.agent_group),
                                    ("policy_chars", args.policy_chars)) if v is not None})
    if args.domain != "standin":
        from ..workloads.tau2 import DOMAINS

        domains = DOMAINS if args.domain == "all" else (args.domain,)
        if args.stats_only:
            suffix = "" if args.domain == "all" else f"-{args.domain}"  # one domain's numbers beside all domains'
            run_stats(domains, sizes["tasks"], sizes["group"], out=f"benchmarks/results/tau2-agent-stats{suffix}.csv")
            return
        if len(domains) != 1:
            raise SystemExit("--domain all only with --stats-only; train one domain at a time")
        sizes.update(domain=args.domain, shape=shape)
    _, _, episodes = agent_episodes(sizes)
    turns = [len(e.turns) for e in episodes]
    log(f"== agent: {sizes}; {len(episodes)} episodes, {min(turns)}-{max(turns)} turns, prompt "
               f"{episodes[0].prompt_length} tokens, episodes {min(len(e.ids) for e in episodes)}-"
               f"{max(len(e.ids) for e in episodes)} tokens, {len({tuple(e.ids) for e in episodes})} distinct")
    rows = []
    for layout in args.agent_layouts:
        for method in args.agent_methods:
            try:
                row = run_isolated(measure_agent, sizes, layout, method, shape, args.device, args.dtype,
                                          args.steps, threads, isolate=not args.no_isolate)
                log(f"   {layout:9s} {method:6s} {row['step_s']:8.2f} s/step compression "
                           f"{row['compression_ratio']:.2f} ideal {row['ideal_ratio']:.2f} peak "
                           f"{row['peak_mem_mb']:8.0f} MB")
            except RuntimeError as e:
                msg = str(e).strip().splitlines()
                log(f"   {layout:9s} {method:6s} FAILED: {msg[0] if msg else e}\n" + "\n".join(msg[-12:]))
                row = {"workload": f"agent-{layout}", "method": method, "error": msg[0] if msg else "failed"}
            rows.append(row)
    fill_ratios(rows)
    reference = next((r for r in rows if r["workload"] == "agent-episode" and r["method"] == "dense"
                      and r.get("step_s")), None)
    for row in rows:  # step times across layouts: the layouts train different row counts over the same episodes
        row["step_vs_dense_episode"] = reference["step_s"] / row["step_s"] if reference and row.get("step_s") else None
    name = "trainer-agent" + ("" if args.domain == "standin" else f"-tau2-{args.domain}") + \
        ("-quick" if args.quick else "") + ("" if args.device == "cpu" else f"-{args.device}-{args.dtype}") + \
        (f"-{shape}" if args.model_shape else "")
    path = write_csv(rows, f"benchmarks/results/{name}.csv")
    plot(path)
    table = markdown_table(rows, columns=AGENT_COLUMNS)
    command = "python -m benchmarks.suites.bench_trainer --agent" + (" --quick" if args.quick else "") + \
        ("" if args.domain == "standin" else f" --domain {args.domain}")
    path.with_suffix(".md").write_text(f"`{command}`: model {shape}, {args.device}, {args.dtype}, {sizes}\n\n"
                                       f"{table}\n")
    print(table)


STATS_COLUMNS = ("domain", "tasks", "group", "system_prompt_tokens", "policy_tokens", "turns_per_episode",
                 "mean_episode_tokens", "gold_reward", "variant_reward", "episode_rows", "episode_tokens",
                 "episode_compression", "per_turn_rows", "per_turn_tokens", "per_turn_compression")


def run_stats(domains, tasks: int, group: int, out: str = "benchmarks/results/tau2-agent-stats.csv") -> list[dict]:
    """`--agent --stats-only`: the tau2 workload numbers of every domain (`workloads.tau2.workload_stats`), written as
    CSV, plot and markdown table."""
    from ..workloads.tau2 import bpe_chat_tokenizer, workload_stats

    tokenizer = bpe_chat_tokenizer()
    rows = []
    for name in domains:
        stats, _ = workload_stats(name, tasks, group, tokenizer)
        log(f"   {name:8s} " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in stats.items() if k != "domain"))
        rows.append(stats)
    path = write_csv(rows, out)
    plot_tau2_stats(rows, path.with_suffix(".png"))
    command = f"python -m benchmarks.suites.bench_trainer --agent --stats-only --domain all --agent-tasks {tasks} " \
              f"--agent-group {group}"
    path.with_suffix(".md").write_text(f"`{command}`\n\n{markdown_table(rows, columns=STATS_COLUMNS)}\n")
    return rows

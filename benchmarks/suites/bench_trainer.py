"""Trainer-level benchmark: TRL's `GRPOTrainer` vs `DTAGRPOTrainer`, a whole optimizer step, generation excluded.

Both trainers get the same fixed rollout batch from `_generate_and_score_completions` (overridden in a subclass so that
generation and rewards take no time and every step sees the same tokens; everything after it is the trainers' own
code: TRL's row shuffle or DTA's group-aware split, micro-batching, `_compute_loss` or the engine, backward,
gradient accumulation, AdamW, metrics). One optimizer step covers the whole generation batch
(`gradient_accumulation_steps = steps_per_generation`). By default a micro-batch holds one group
(`per_device_train_batch_size = num_generations`): DTA shares prefixes within a micro-batch only, so smaller
micro-batches split a group and lose sharing (with 4 rows per micro-batch a 16-completion group compresses 2.5x
instead of 4x).

```
python -m benchmarks.bench_trainer --quick
python -m benchmarks.bench_trainer --device cuda --dtype bf16 --model-shape qwen3-1.7b
python -m benchmarks.bench_trainer --compression     # tree compression per micro-batch vs per optimizer step only
python -m benchmarks.bench_trainer --agent --quick   # multi-turn agent episodes, episode and per-turn layouts
```

Methods: `trl` (GRPOTrainer, `gradient_checkpointing=False`), `trl+ckpt` (TRL's default, HF checkpointing), `dta`
(DTAGRPOTrainer keeping every graph), `dta+ckpt` (`gradient_checkpointing=True`: DTA's block recompute). Writes
`benchmarks/results/trainer[-quick][-<shape> with --model-shape].csv/.png/.md`.

`--agent`: multi-turn episodes of the offline retail environment (`trl_dta.envs`), played by a scripted agent and
replayed to `DTAGRPOTrainer` through TRL's `rollout_func` ([`ReplayRollout`]), in both sample layouts
(`dta_sample_layout="episode"` and `"per_turn"`). Methods per layout: `dense` (`dta_enabled=False`: TRL's dense path
on the same rows; in the episode layout that is `GRPOTrainer`'s computation) and `dta`. The ideal FLOP ratio and the
compression are those of the step's forest (all rows of the generation: one generation per optimizer step) over the
dense run of the same layout; `step_vs_dense_episode` compares step times across layouts. Writes
`benchmarks/results/trainer-agent[-quick][-<shape>].csv/.png/.md`.

`--agent --domain airline|retail|telecom|mock`: the same on a real tau2-bench domain (`benchmarks.tau2_workload`):
gold-action episodes and variants of them, tau2's system prompt and tool schemas, tool outputs from the real database,
lengths of a real BPE tokenizer (DeepSeek's, bundled with litellm). `--stats-only --domain all` prints the workload
numbers of every domain without training (`benchmarks/results/tau2-agent-stats.*`).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from trl_dta.flops import dense_flops, tree_flops

from . import common, workloads

if TYPE_CHECKING:
    from trl_dta.trainers import DTAGRPOConfig

METHODS = ("trl", "trl+ckpt", "dta", "dta+ckpt")


def rollout_batch(workload: workloads.Workload, prompt_len: int, seed: int = 0) -> dict:
    """The workload as the dict `_generate_and_score_completions` returns (prompts left-, completions right-padded).

    Rows are in generation order (a group's completions adjacent), advantages are seeded random numbers.
    """
    seqs = workload.seqs
    completions = [s[prompt_len:] for s in seqs]
    width = max(len(c) for c in completions)
    n = len(seqs)
    prompt_ids = torch.stack([s[:prompt_len] for s in seqs])
    completion_ids = torch.zeros(n, width, dtype=torch.long)
    completion_mask = torch.zeros(n, width, dtype=torch.long)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c)] = c
        completion_mask[i, : len(c)] = 1
    gen = torch.Generator().manual_seed(seed)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(n, generator=gen),
        "num_items_in_batch": completion_mask.sum(),
    }


def step_compression(accumulations=(1, 4, 8), micro_batch_size: int = 8, micro_batches: int = 8,
                     seed: int = 0) -> list[dict]:
    """Compression per micro-batch vs per optimizer step on the GRPO grid, computed from the trees (no training).

    A generation batch of `micro_batch_size * micro_batches` rows (whole prompt groups) is shuffled with TRL's draw
    (`torch.randperm`, as `shuffle_sequence_dict`) and cut into `micro_batches` micro-batches of TRL's size; an
    optimizer step accumulates `gradient_accumulation_steps` of them. `per_micro_batch` = tokens / the summed tree
    tokens of the micro-batches (DTA before whole-step forests), `per_step` = tokens / the summed tree tokens of the
    steps' forests (one forest per optimizer step), `whole_batch` = the generation batch as one tree.
    """
    from trl_dta.tree import PrefixTree

    rows = []
    n = micro_batch_size * micro_batches
    for prompt_len, group, completion_len in workloads.GRPO_GRID:
        w = workloads.grpo(prompt_len, group, completion_len, n_prompts=n // group, seed=seed)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        seqs = [w.seqs[i] for i in order]
        micro = [seqs[i : i + micro_batch_size] for i in range(0, n, micro_batch_size)]
        tokens = sum(len(s) for s in seqs)
        micro_tree = sum(PrefixTree.from_sequences(m).n_tree_tokens for m in micro)
        for accumulation in accumulations:
            steps = [[s for m in micro[i : i + accumulation] for s in m] for i in range(0, micro_batches, accumulation)]
            step_tree = sum(PrefixTree.from_sequences(step).n_tree_tokens for step in steps)
            rows.append({
                "workload": w.name,
                "rows": n,
                "micro_batch_size": micro_batch_size,
                "gradient_accumulation_steps": accumulation,
                "per_micro_batch": round(tokens / micro_tree, 3),
                "per_step": round(tokens / step_tree, 3),
                "whole_batch": round(w.tree().compression_ratio, 3),
            })
    return rows


def _trainer_class(method: str):
    from trl import GRPOTrainer

    from trl_dta.trainers.grpo import DTAGRPOTrainer

    base = DTAGRPOTrainer if method.startswith("dta") else GRPOTrainer

    class FixedRollouts(base):
        """`_generate_and_score_completions` returns the benchmark's fixed batch (on the trainer's device)."""

        bench_batch: dict = {}

        def _generate_and_score_completions(self, inputs):
            return {k: v.to(self.accelerator.device) for k, v in self.bench_batch.items()}

    return FixedRollouts


def bench_config(out: str, *, micro_batch_size: int, micro_batches: int, group: int, steps: int, dtype: str,
                 device: str, seed: int, **overrides) -> DTAGRPOConfig:
    """The config every trainer benchmark uses: one generation per optimizer step (`steps_per_generation` =
    gradient accumulation = `micro_batches`), one warm-up step plus `steps` timed ones, every batch through DTA when it
    is enabled (`dta_min_compression=0`), no logging, saving or dropout; `overrides` are the run's own settings."""
    from trl_dta.trainers.grpo import DTAGRPOConfig

    return DTAGRPOConfig(
        output_dir=out, per_device_train_batch_size=micro_batch_size, gradient_accumulation_steps=micro_batches,
        steps_per_generation=micro_batches, num_generations=group, max_steps=1 + steps, learning_rate=1e-6,
        bf16=dtype == "bf16", use_cpu=device == "cpu", report_to="none", logging_steps=10_000, save_strategy="no",
        disable_dropout=True, dta_min_compression=0.0, dataloader_num_workers=0, seed=seed, **overrides,
    )


def step_timer(device: str):
    """A `TrainerCallback` timing each optimizer step (`.times`, seconds) and the peak memory of the steps after the
    first (`.memory`, a `common.PeakMemory` reset at the end of the warm-up step, optimizer state allocated)."""
    from transformers import TrainerCallback

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.memory = common.PeakMemory(device)

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.times.append(time.perf_counter() - self.t0)
            if len(self.times) == 1:
                self.memory.reset()

    return StepTimer()


def measure(workload: workloads.Workload, prompt_len: int, group: int, method: str, shape: str, device: str,
            dtype: str, micro_batch_size: int, steps: int, threads: int | None, seed: int = 0) -> dict:
    """Train `1 + steps` optimizer steps and time the last `steps` (call through `common.run_isolated`)."""
    from datasets import Dataset

    from trl_dta.tiny import build_tokenizer

    common.set_threads(threads)
    # bf16 runs keep float32 parameters and let the trainers autocast (`bf16=True`), as TRL does by default
    model = common.build_model(shape, common.parse_dtype(dtype) if dtype != "bf16" else torch.float32, device,
                               seed=seed)
    n = len(workload.seqs)
    if n % micro_batch_size:
        raise ValueError(f"{n} rollouts are not a multiple of micro_batch_size {micro_batch_size}")
    k = n // micro_batch_size
    cls = _trainer_class(method)
    cls.bench_batch = rollout_batch(workload, prompt_len, seed)
    timer = step_timer(device)
    with tempfile.TemporaryDirectory() as out:
        config = bench_config(out, micro_batch_size=micro_batch_size, micro_batches=k, group=group, steps=steps,
                              dtype=dtype, device=device, seed=seed,
                              gradient_checkpointing=method.endswith("+ckpt"))
        prompts = Dataset.from_dict({"prompt": ["x"] * (n // group) * (2 + steps)})
        trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                      train_dataset=prompts, processing_class=build_tokenizer(), callbacks=[timer])
        trainer.train()
        peak = timer.memory.peak_mb()
    timed = sorted(timer.times[1:])
    tree = workload.tree()
    # a micro-batch is a tree of its own: the ideal ratio is over micro-batches of whole groups (DTA's split)
    seqs = workload.seqs
    parts = [seqs[i : i + micro_batch_size] for i in range(0, n, micro_batch_size)]
    model_shape = common.model_shape(shape)
    ideal = dense_flops(tree.lengths, model_shape).total / sum(tree_flops(p, model_shape).total for p in parts)
    return {
        "workload": workload.name,
        "method": method,
        "n_sequences": n,
        "n_tokens": tree.n_tokens,
        "n_tree_tokens": tree.n_tree_tokens,
        "compression_ratio": tree.compression_ratio,
        "ideal_ratio": ideal,
        "micro_batch_size": micro_batch_size,
        "step_s": timed[0],
        "median_step_s": timed[len(timed) // 2],
        "tokens_per_s": tree.n_tokens / timed[0],
        "peak_mem_mb": max(peak, 0.0),
        "model_shape": common.model_shape(shape).name,
        "device": device,
        "dtype": dtype,
        "loadavg": os.getloadavg()[0],
    }


# ------------------------------------------------------------------------------------------------ agent workload

AGENT_LAYOUTS = ("episode", "per_turn")
AGENT_METHODS = ("dense", "dta")
# tasks per optimizer step, episodes per task (G), policy document in characters (= tokens with the tiny
# character tokenizer), agent turns per episode, tokens per episode
AGENT_SIZES = {
    "quick": {"tasks": 2, "group": 4, "policy_chars": 0, "max_turns": 5, "max_tokens": 2048},
    "full": {"tasks": 4, "group": 8, "policy_chars": 2048, "max_turns": 8, "max_tokens": 4096},
}
# What the scripted agent may ask before acting; the simulated user answers each (`trl_dta.envs.user`).
_QUESTIONS = ("say may i have your name?", "say what is your zip code?", "say which order is it about?",
              "say what is the reason for the call?")


def agent_script(task, variant: int) -> list[str]:
    """Turn texts of the scripted agent's `variant`-th episode of a task: it branches at several depths.

    Bit 0 of `variant` picks the first question, bit 1 the second, bit 2 adds a lookup of a wrong order before the
    task's gold actions; every third variant closes with `say done` instead of the required information (the user
    then repeats the request until it hangs up or the turn limit ends the call), so rewards differ within a group.
    """
    turns = [_QUESTIONS[variant % 2], _QUESTIONS[2 + variant // 2 % 2]]
    if variant // 4 % 2:
        turns.append(f"call get-order order=o9{variant}")
    turns += [action.render() for action in task.gold_actions]
    turns.append("say done" if variant % 3 == 2 else "say " + " ".join(task.required_info))
    return turns


class _Tau2Prompts:
    """The task lookup of [`ReplayRollout`] for tau2 workloads: dataset prompts are `"tau2 task <id>"`."""

    @staticmethod
    def task_id_of(prompt: str) -> str:
        return prompt.removeprefix("tau2 task ")


def agent_episodes(sizes: dict, seed: int = 0):
    """The `group` scripted episodes of each of `tasks` tasks, played in the stand-in retail environment
    (`trl_dta.envs`), or, with `sizes["domain"]` a tau2 domain, gold-action episodes of the real domain
    (`benchmarks.tau2_workload`, ids relabelled compactly for the benchmark model's vocabulary).

    Returns:
        `tuple[domain, tokenizer, list[Episode]]`: episodes task by task, a task's `group` episodes adjacent.
    """
    if sizes.get("domain", "standin") != "standin":
        from trl_dta.envs.tau2 import Tau2Domain
        from trl_dta.tiny import build_tokenizer

        from . import tau2_workload

        bpe = tau2_workload.bpe_chat_tokenizer()
        domain = Tau2Domain(sizes["domain"])
        episodes = tau2_workload.gold_episodes(domain, tau2_workload.domain_task_ids(domain, sizes["tasks"]),
                                               sizes["group"], bpe)
        tokenizer = build_tokenizer()  # pad 0, eos 2: the relabelled episodes' special ids
        vocab = common.model_shape(sizes.get("shape", "bench-cpu")).vocab_size
        tau2_workload.compact_ids(episodes, vocab, bpe.eos_token_id, new_eos=tokenizer.eos_token_id)
        return _Tau2Prompts(), tokenizer, episodes
    from trl_dta.envs import Generation, RetailDomain, play_episodes
    from trl_dta.tiny import build_tokenizer

    domain = RetailDomain(seed=seed, policy_chars=sizes["policy_chars"])
    tokenizer = build_tokenizer()
    episodes = []
    for task_id in range(sizes["tasks"]):
        for variant in range(sizes["group"]):
            turns = iter(agent_script(domain.task(task_id), variant))

            def generate(prefixes, max_new_tokens, turns=turns):
                ids = tokenizer(next(turns, "say bye"), add_special_tokens=False)["input_ids"]
                return [Generation((ids + [tokenizer.eos_token_id])[: max_new_tokens[0]], None)]

            episodes += play_episodes(domain, [task_id], generate, tokenizer, max_turns=sizes["max_turns"],
                                      max_turn_tokens=64, max_tokens=sizes["max_tokens"])
    return domain, tokenizer, episodes


class ReplayRollout:
    """TRL's `rollout_func` replaying fixed episodes: the `k`-th copy of a task's prompt in a call gets the task's
    `k`-th episode (TRL repeats each prompt `num_generations` times). Keys as `trl_dta.envs.AgentRolloutFunc`."""

    def __init__(self, domain, episodes):
        self.domain = domain
        self.by_task: dict[int, list] = {}
        for episode in episodes:
            self.by_task.setdefault(episode.task_id, []).append(episode)

    def __call__(self, prompts, trainer):
        seen, episodes = Counter(), []
        for prompt in prompts:
            task_id = self.domain.task_id_of(prompt)
            group = self.by_task[task_id]
            episodes.append(group[seen[task_id] % len(group)])
            seen[task_id] += 1
        return {
            "prompt_ids": [e.ids[: e.prompt_length] for e in episodes],
            "completion_ids": [e.ids[e.prompt_length :] for e in episodes],
            "logprobs": None,
            "env_mask": [e.env_mask[e.prompt_length :] for e in episodes],
            "episode_reward": [e.reward.reward for e in episodes],
        }


def agent_forest(episodes, layout: str, shape: str) -> dict:
    """The step's forest (every row of the generation) in a layout: tokens, tree tokens, compression, ideal ratio."""
    from trl_dta.envs import layout_sequences
    from trl_dta.tree import PrefixTree

    seqs = layout_sequences(episodes, layout)
    tree = PrefixTree.from_sequences(seqs)
    return {
        "n_sequences": len(seqs),
        "n_tokens": tree.n_tokens,
        "n_tree_tokens": tree.n_tree_tokens,
        "compression_ratio": tree.compression_ratio,
        "ideal_ratio": dense_flops(tree.lengths, shape).total / tree_flops(tree, shape).total,
    }


def measure_agent(sizes: dict, layout: str, method: str, shape: str, device: str, dtype: str, steps: int,
                  threads: int | None, seed: int = 0) -> dict:
    """Train `1 + steps` optimizer steps of replayed episodes and time the last `steps` (via `common.run_isolated`).

    One optimizer step = one generation of `tasks * group` episodes: `per_device_train_batch_size = group`,
    `gradient_accumulation_steps = steps_per_generation = tasks`; the dataset holds the `tasks` tasks, so every step
    trains the same rows (in TRL's shuffled order).
    """
    from trl_dta.envs import build_dataset, episode_reward
    from trl_dta.trainers.grpo import DTAGRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    common.set_threads(threads)
    domain, tokenizer, episodes = agent_episodes(sizes, seed)
    model = common.build_model(shape, common.parse_dtype(dtype) if dtype != "bf16" else torch.float32, device,
                               seed=seed)
    timer = step_timer(device)
    with tempfile.TemporaryDirectory() as out:
        config = bench_config(out, micro_batch_size=sizes["group"], micro_batches=sizes["tasks"], group=sizes["group"],
                              steps=steps, dtype=dtype, device=device, seed=seed, max_completion_length=64,
                              gradient_checkpointing=False,  # both methods keep every graph (the fastest of each)
                              dta_enabled=method == "dta", dta_sample_layout=layout)
        if isinstance(domain, _Tau2Prompts):
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
        "model_shape": common.model_shape(shape).name,
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
        from . import tau2_workload

        domains = tau2_workload.DOMAINS if args.domain == "all" else (args.domain,)
        if args.stats_only:
            suffix = "" if args.domain == "all" else f"-{args.domain}"  # one domain's numbers beside all domains'
            tau2_workload.run_stats(domains, sizes["tasks"], sizes["group"],
                                    out=f"benchmarks/results/tau2-agent-stats{suffix}.csv")
            return
        if len(domains) != 1:
            raise SystemExit("--domain all only with --stats-only; train one domain at a time")
        sizes.update(domain=args.domain, shape=shape)
    _, _, episodes = agent_episodes(sizes)
    turns = [len(e.turns) for e in episodes]
    common.log(f"== agent: {sizes}; {len(episodes)} episodes, {min(turns)}-{max(turns)} turns, prompt "
               f"{episodes[0].prompt_length} tokens, episodes {min(len(e.ids) for e in episodes)}-"
               f"{max(len(e.ids) for e in episodes)} tokens, {len({tuple(e.ids) for e in episodes})} distinct")
    rows = []
    for layout in args.agent_layouts:
        for method in args.agent_methods:
            try:
                row = common.run_isolated(measure_agent, sizes, layout, method, shape, args.device, args.dtype,
                                          args.steps, threads, isolate=not args.no_isolate)
                common.log(f"   {layout:9s} {method:6s} {row['step_s']:8.2f} s/step compression "
                           f"{row['compression_ratio']:.2f} ideal {row['ideal_ratio']:.2f} peak "
                           f"{row['peak_mem_mb']:8.0f} MB")
            except RuntimeError as e:
                msg = str(e).strip().splitlines()
                common.log(f"   {layout:9s} {method:6s} FAILED: {msg[0] if msg else e}\n" + "\n".join(msg[-12:]))
                row = {"workload": f"agent-{layout}", "method": method, "error": msg[0] if msg else "failed"}
            rows.append(row)
    common.fill_ratios(rows)
    reference = next((r for r in rows if r["workload"] == "agent-episode" and r["method"] == "dense"
                      and r.get("step_s")), None)
    for row in rows:  # step times across layouts: the layouts train different row counts over the same episodes
        row["step_vs_dense_episode"] = reference["step_s"] / row["step_s"] if reference and row.get("step_s") else None
    name = "trainer-agent" + ("" if args.domain == "standin" else f"-tau2-{args.domain}") + \
        ("-quick" if args.quick else "") + ("" if args.device == "cpu" else f"-{args.device}-{args.dtype}") + \
        (f"-{shape}" if args.model_shape else "")
    path = common.write_csv(rows, f"benchmarks/results/{name}.csv")
    common.plot(path)
    table = common.markdown_table(rows, columns=AGENT_COLUMNS)
    command = "python -m benchmarks.bench_trainer --agent" + (" --quick" if args.quick else "") + \
        ("" if args.domain == "standin" else f" --domain {args.domain}")
    path.with_suffix(".md").write_text(f"`{command}`: model {shape}, {args.device}, {args.dtype}, {sizes}\n\n"
                                       f"{table}\n")
    print(table)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model-shape", default=None, help="bench-cpu (default), ...; smollm2: SmolLM2-135M's real weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--methods", default=",".join(METHODS), type=common.names(METHODS, "method"))
    p.add_argument("--micro-batch-size", type=int, default=0,
                   help="per_device_train_batch_size (default 0: one group per micro-batch, the group size)")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps (after one warm-up step)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-isolate", action="store_true")
    p.add_argument("--compression", action="store_true",
                   help="only print the tree compression per micro-batch vs per optimizer step (no training)")
    p.add_argument("--agent", action="store_true",
                   help="multi-turn agent episodes, dense and DTA in the episode and per-turn layouts")
    p.add_argument("--agent-tasks", type=int, default=None, help="--agent: tasks per optimizer step (preset: 2/4)")
    p.add_argument("--agent-group", type=int, default=None, help="--agent: episodes per task, G (preset: 4/8)")
    p.add_argument("--agent-methods", default=",".join(AGENT_METHODS), type=common.names(AGENT_METHODS, "method"),
                   help="--agent: methods to run (e.g. `dta` alone where the dense rows would take hours: airline "
                   "per-turn at SmolLM2's size is 546K dense tokens per step)")
    p.add_argument("--agent-layouts", default=",".join(AGENT_LAYOUTS), type=common.names(AGENT_LAYOUTS, "layout"),
                   help="--agent: sample layouts to run")
    p.add_argument("--policy-chars", type=int, default=None,
                   help="--agent: system prompt length in characters = tokens (preset: 0 (~500)/2048)")
    p.add_argument("--domain", default="standin", choices=["standin", "airline", "retail", "telecom", "mock", "all"],
                   help="--agent: the stand-in retail domain, or a real tau2-bench domain (trl-dta[tau2]): gold-action "
                   "episodes, real system prompt and tools, DeepSeek BPE lengths")
    p.add_argument("--stats-only", action="store_true",
                   help="--agent --domain: only the workload numbers (prompt tokens, turns, compression per layout, "
                   "gold reward), no training; writes benchmarks/results/tau2-agent-stats[-<domain>].*")
    args = p.parse_args(argv)
    if args.compression:
        rows = step_compression()
        print(common.markdown_table(rows, columns=list(rows[0])))
        return

    cpu = args.device == "cpu"
    shape = args.model_shape or ("bench-cpu-quick" if args.quick else "bench-cpu")
    threads = args.threads if args.threads is not None else (1 if cpu else None)
    if args.agent:
        run_agent(args, shape, threads)
        return
    vocab = min(common.model_shape(shape).vocab_size, 32768)
    scale_g, scale_m = (0.25, 0.125) if args.quick else (1.0, 1.0)
    if shape in common.PRETRAINED_SHAPES and args.quick:  # SmolLM2's real weights on this CPU: a quarter of that
        scale_g, scale_m = 1 / 16, 1 / 32
    grpo = workloads.grpo(1024, 16, 256, scale=scale_g, vocab_size=vocab)
    agent = workloads.multi_turn(scale=scale_m, vocab_size=vocab)
    grid = [
        (grpo, grpo.params["prompt_len"], 16),
        (agent, agent.params["system_len"] + agent.params["task_len"], agent.params["group"]),
    ]
    rows = []
    for w, prompt_len, group in grid:
        common.log(f"== {w.name} ({w.description})")
        for method in args.methods:
            try:
                row = common.run_isolated(measure, w, prompt_len, group, method, shape, args.device, args.dtype,
                                          args.micro_batch_size or group, args.steps, threads,
                                          isolate=not args.no_isolate)
                common.log(f"   {method:10s} {row['step_s']:8.2f} s/step {row['tokens_per_s']:9.0f} tok/s "
                           f"peak {row['peak_mem_mb']:8.0f} MB")
            except RuntimeError as e:
                msg = str(e).strip().splitlines()
                common.log(f"   {method:10s} FAILED: {msg[0] if msg else e}\n" + "\n".join(msg[-12:]))
                row = {"workload": w.name, "method": method, "error": msg[0] if msg else "failed"}
            rows.append(row)
    for r in rows:  # the dense reference of this benchmark is TRL's trainer
        r["method"] = {"trl": "dense", "trl+ckpt": "dense+ckpt"}.get(r["method"], r["method"])
    common.fill_ratios(rows)
    name = "trainer" + ("-quick" if args.quick else "") + ("" if cpu else f"-{args.device}-{args.dtype}") + \
        (f"-{shape}" if args.model_shape else "")
    path = common.write_csv(rows, f"benchmarks/results/{name}.csv")
    common.plot(path)
    table = common.markdown_table(rows)
    (path.with_suffix(".md")).write_text(f"model {shape}, {args.device}, {args.dtype}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()

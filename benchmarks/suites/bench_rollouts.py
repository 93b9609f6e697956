"""Multi-turn agent rollouts: the re-prefill path (`model.generate` on every whole prefix) vs the generation cache
(`trl_dta.generation.CachedGenerate`), per domain, and tau2's evaluator with and without the copying constructor.

For each domain (the stand-in, and tau2's `mock`, `airline`, `retail` with their whole system prompts and tool schemas
in TRL's Qwen2.5 chat template, byte-level tokens) the same episodes (same seed, same tiny random model: the same
token ids, checked) are played by both methods, each in its own forked process (so that its peak memory is its own,
under an address-space limit so that the re-prefill path cannot take the shared machine down):

- `rollout_tokens`: tokens of the episodes, each at its final length; `forward_tokens`: positions the policy forwarded
  while generating (padding included: `generation.count_forward_tokens`);
- `generation_s`, `env_s` (tools and users), `reward_s` (the grader), `rollout_s`, `peak_rss_mb` (above the process's
  baseline before the rollout), and the ratios `forward_ratio` and `generation_speedup` (re-prefill / cache);
- `eval_stock_s` / `eval_copying_s` (tau2 domains): seconds per episode of tau2's `evaluate_simulation` on the
  rollout's trajectories with tau2's registered constructor (the database file parsed per environment) and with
  `CopyingConstructor` (parsed once, copied).

```
python -m benchmarks.suites.bench_rollouts --quick                      # every domain, 1 task x 2 episodes x 2 turns
python -m benchmarks.suites.bench_rollouts --domains mock standin --tasks 2 --episodes 4 --turns 3
```

Writes `benchmarks/results/rollouts[-quick].csv`, `.md` and `.png` (forward tokens and generation seconds per domain
and method).
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import torch

from ..harness.cli import log, set_threads
from ..harness.isolation import run_isolated
from ..harness.memory import PeakMemory
from ..reporting.results import RESULTS_DIR, markdown_table

DOMAINS = ("standin", "mock", "airline", "retail")
METHODS = ("reprefill", "cached")
COLUMNS = ["domain", "method", "tasks", "episodes", "turns", "turn_tokens", "system_prompt_tokens", "rollout_tokens",
           "forward_tokens", "forward_ratio", "generation_s", "generation_speedup", "env_s", "reward_s", "rollout_s",
           "peak_rss_mb", "eval_stock_s", "eval_copying_s", "same_episodes", "status", "loadavg"]
MEMORY_LIMIT = 10 * 2**30  # address space of each run's process


def _workload(domain_name: str, tasks: int):
    """`(play(generate) -> episodes, tokenizer, model, system_prompt_tokens, tau2 domain or None)`."""
    from trl_dta.demos import tiny
    from trl_dta.envs import RetailDomain, play_episodes
    from trl_dta.envs.retail.protocol import protocol_tokenizer

    if domain_name == "standin":
        domain, tokenizer = RetailDomain(seed=0), protocol_tokenizer()
        system = len(tokenizer(domain.system_prompt)["input_ids"])
        model = tiny.build_model(tokenizer, max_position_embeddings=4096, seed=0).eval()

        def play(generate, episodes, turns, turn_tokens, timings):
            return play_episodes(domain, list(range(tasks)), generate, tokenizer, num_generations=episodes,
                                 max_turns=turns, max_turn_tokens=turn_tokens, max_tokens=4096, timings=timings)

        return play, tokenizer, model, system, None
    from trl_dta.envs.core.chat import ChatRenderer, build_chat_tokenizer
    from trl_dta.envs.tau2 import Tau2Domain, play_tau2_episodes

    domain, tokenizer = Tau2Domain(domain_name), build_chat_tokenizer("qwen2_5")
    renderer = ChatRenderer(tokenizer, domain.tool_schemas)
    system = len(renderer.prompt_ids([{"role": "system", "content": domain.system_prompt}]))
    model = tiny.build_model(tokenizer, max_position_embeddings=65536, seed=0).eval()
    task_ids = domain.task_ids[:tasks]

    def play(generate, episodes, turns, turn_tokens, timings):
        return play_tau2_episodes(domain, task_ids, generate, renderer, num_generations=episodes, max_turns=turns,
                                  max_turn_tokens=turn_tokens, max_tokens=system + turns * (turn_tokens + 2048) + 512,
                                  timings=timings)

    return play, tokenizer, model, system, domain


def _evaluator_seconds(domain, episodes) -> tuple[float, float]:
    """Seconds per episode of tau2's evaluator with tau2's constructor and with the copying one."""
    from datetime import datetime, timezone

    from trl_dta.envs.tau2 import tau2_modules

    t = tau2_modules()
    out = []
    for registered in (domain.name, domain.registered):
        start = time.perf_counter()
        for _episode, session in episodes:
            now = datetime.now(timezone.utc).isoformat()
            run = t.simulation.SimulationRun(id="x", task_id=session.task.id, start_time=now, end_time=now,
                                             duration=0.0, termination_reason="user_stop",
                                             messages=list(session.trajectory))
            try:
                t.evaluator.evaluate_simulation(simulation=run, task=session.task, domain=registered,
                                                solo_mode=False, evaluation_type=t.evaluator.EvaluationType.ALL)
            except Exception:  # noqa: BLE001 - tau2's assertions can raise on missing state: timed all the same
                pass
        out.append((time.perf_counter() - start) / max(len(episodes), 1))
    return out[0], out[1]


def run_one(domain_name: str, method: str, tasks: int, episodes: int, turns: int, turn_tokens: int) -> dict:
    """One rollout in this (forked) process; returns its row."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    from trl_dta.generation import CachedGenerate, count_forward_tokens, reprefill_generate_fn

    play, tokenizer, model, system, domain = _workload(domain_name, tasks)
    generate_fn = CachedGenerate(model, tokenizer) if method == "cached" else reprefill_generate_fn(model, tokenizer)
    spent = [0.0]

    def generate(prefixes, budgets):
        start = time.perf_counter()
        try:
            return generate_fn(prefixes, budgets)
        finally:
            spent[0] += time.perf_counter() - start

    sessions = []
    if domain is not None:  # keep the sessions, for the evaluator timing
        from trl_dta.envs.tau2 import episode as episode_module

        original = episode_module.Tau2Session.__init__

        def keep(self, *args, **kwargs):
            original(self, *args, **kwargs)
            sessions.append(self)

        episode_module.Tau2Session.__init__ = keep
    memory = PeakMemory("cpu")
    memory.reset()
    timings: dict = {}
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad(), count_forward_tokens(model) as forwarded:
        played = play(generate, episodes, turns, turn_tokens, timings)
    rollout_s = time.perf_counter() - start
    row = {"domain": domain_name, "method": method, "tasks": tasks, "episodes": len(played), "turns": turns,
           "turn_tokens": turn_tokens, "system_prompt_tokens": system,
           "rollout_tokens": sum(len(e.ids) for e in played), "forward_tokens": forwarded[0],
           "generation_s": spent[0], "reward_s": timings.get("reward_s", 0.0),
           "env_s": rollout_s - spent[0] - timings.get("reward_s", 0.0), "rollout_s": rollout_s,
           "peak_rss_mb": memory.peak_mb(), "ids": [e.ids for e in played], "status": "ok",
           "loadavg": os.getloadavg()[0]}
    if domain is not None and method == "cached":
        row["eval_stock_s"], row["eval_copying_s"] = _evaluator_seconds(domain, list(zip(played, sessions)))
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 task x 2 episodes x 2 turns of 64 tokens per domain")
    parser.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=DOMAINS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=4, help="episodes per task")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.tasks, args.episodes, args.turns, args.turn_tokens = 1, 2, 2, 64
    set_threads(args.threads)
    rows = []
    for domain in args.domains:
        runs = {}
        for method in args.methods:
            log(f"{domain} {method} ...")
            try:
                runs[method] = run_isolated(run_one, domain, method, args.tasks, args.episodes, args.turns,
                                                   args.turn_tokens)
            except RuntimeError as error:  # out of memory under the limit, or a crash: a row that says so
                first = str(error).splitlines()[0][:120]
                runs[method] = {"domain": domain, "method": method, "tasks": args.tasks, "turns": args.turns,
                                "turn_tokens": args.turn_tokens, "status": f"failed: {first}"}
            log(f"  {runs[method].get('status')} {runs[method].get('rollout_s')}")
        ref, new = runs.get("reprefill"), runs.get("cached")
        same = None
        if ref and new and "ids" in ref and "ids" in new:
            same = ref["ids"] == new["ids"]
            new["forward_ratio"] = ref["forward_tokens"] / max(new["forward_tokens"], 1)
            new["generation_speedup"] = ref["generation_s"] / max(new["generation_s"], 1e-9)
        for run in runs.values():
            run.pop("ids", None)
            run["same_episodes"] = same
            rows.append(run)
    name = "rollouts-quick" if args.quick else "rollouts"
    out = Path(args.out) if args.out else RESULTS_DIR / f"{name}.csv"
    _write(rows, out)
    out.with_suffix(".md").write_text(markdown_table(rows, COLUMNS) + "\n")
    _plot(rows, out.with_suffix(".png"))
    print(markdown_table(rows, COLUMNS))


def _write(rows: list[dict], path: Path) -> None:
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c) for c in COLUMNS})


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("status") == "ok"]
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "forward_tokens", "tokens forwarded while generating"),
                           (axes[1], "generation_s", "generation seconds")):
        for m, method in enumerate(METHODS):
            xs = [d + (m - 0.5) * 0.4 for d, domain in enumerate(domains)
                  for r in rows if r["domain"] == domain and r["method"] == method]
            ys = [r[key] for domain in domains for r in rows if r["domain"] == domain and r["method"] == method]
            ax.bar(xs, ys, 0.4, label=method)
        ax.set_xticks(range(len(domains)))
        ax.set_xticklabels(domains)
        ax.set_yscale("log")
        ax.set_title(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

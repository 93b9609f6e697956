"""Load balance of a global batch across K data-parallel ranks: trl-dta's partition against greedy baselines.

Workloads are synthetic global batches of token ids (seeded, no model involved):

- `grpo_g8`, `grpo_g16`: 64 prompts of 200-1000 tokens (after a 24-token chat-template prefix common to all), each
  with 8 or 16 completions of 50-500 tokens; a group is a prompt.
- `agent`: multi-turn agent rollouts (compression about 9x): a 2000-token system prompt shared by all, 32 tasks
  (100-400 tokens each) with 8 rollouts per task, 3-8 turns per rollout (observation 50-400 tokens, response 50-300
  tokens); every turn is one training sequence holding the whole history before it, so turns of a rollout share their
  history; a group is a task.

Methods (costs always the true forest cost of each rank's sequences under the default `CostModel`):

- `dta`: `partition(batch, K)` (strategy "best": the better of the two below), splitting groups where it pays.
- `dta_contiguous`: exact min-max contiguous cut of the sorted batch, least duplication among optimal cuts.
- `dta_packed`: subtrees of the prefix tree packed onto ranks (largest first, exact union costs, local search).
- `dta_groups`: strategy "best" with `group_ids`: whole groups only.
- `dta_equal`: `partition_for_ranks`, the trainers' split (every rank the same number of sequences; whole groups
  when their sizes allow it).
- `ffd_tokens`, `ffd_tree_tokens` (`baselines/lpt.py`): whole groups, largest first, onto the least-loaded rank by
  dense tokens or by the group's own tree tokens. `ffd_tokens_seq`: single sequences by tokens (what a dense
  trainer's row balancing does).
- `max_sharing`: the contiguous cut that duplicates the fewest tree tokens into K non-empty runs, ignoring balance:
  an upper bound on the compression that any split into K non-empty parts can keep (see `methods`).

`agent_64tasks` is `agent` with 64 tasks: every rank must compute the shared system prompt once, which caps the kept
compression at about `1 - (K - 1) * 2000 / tree_tokens`; a global batch twice as large lifts that cap at K = 16.

Metrics: `imbalance` = max / mean rank cost; `compression` = sum of rank tokens / sum of rank tree tokens;
`compression_kept` = compression / single-forest compression. Target: imbalance <= 1.05 with compression_kept >= 0.95.

Run from the repository root: `python -m benchmarks.suites.bench_balance` (writes benchmarks/results/balance.csv and
.png).
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np

from trl_dta.balance import CostModel, Partition, forest_stats, partition, partition_for_ranks
from trl_dta.tree import PrefixTree

from ..baselines.lpt import lpt_partition
from ..reporting.results import RESULTS_DIR

CSV_COLUMNS = ["workload", "k", "method", "imbalance", "compression", "compression_kept", "max_cost", "mean_cost"]
VOCAB = 50_000


def _tokens(rng: np.random.Generator, lo: int, hi: int) -> list[int]:
    return rng.integers(0, VOCAB, int(rng.integers(lo, hi + 1))).tolist()


def grpo_batch(n_prompts: int = 64, group_size: int = 8, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """GRPO global batch: prompts of 200-1000 tokens behind a shared template, `group_size` completions of 50-500."""
    rng = np.random.default_rng(seed)
    template = _tokens(rng, 24, 24)
    seqs, groups = [], []
    for g in range(n_prompts):
        prompt = template + _tokens(rng, 200, 1000)
        for _ in range(group_size):
            seqs.append(prompt + _tokens(rng, 50, 500))
            groups.append(g)
    return seqs, groups


def agent_batch(n_tasks: int = 32, rollouts: int = 8, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Multi-turn agent global batch: one sequence per turn, each holding the whole history (see module docstring)."""
    rng = np.random.default_rng(seed)
    system = _tokens(rng, 2000, 2000)
    seqs, groups = [], []
    for task in range(n_tasks):
        history_task = system + _tokens(rng, 100, 400)
        for _ in range(rollouts):
            history = list(history_task)
            for _ in range(int(rng.integers(3, 9))):
                history += _tokens(rng, 50, 400)  # user / tool observation
                history += _tokens(rng, 50, 300)  # assistant response (trained)
                seqs.append(list(history))
                groups.append(task)
    return seqs, groups


WORKLOADS = {
    "grpo_g8": lambda: grpo_batch(group_size=8),
    "grpo_g16": lambda: grpo_batch(group_size=16),
    "agent": agent_batch,
    "agent_64tasks": lambda: agent_batch(n_tasks=64),
}


def methods(tree: PrefixTree, groups: list[int], k: int, model: CostModel) -> dict[str, Partition]:
    sizes = {groups.count(g) for g in set(groups)}
    equal_groups = len(sizes) == 1 and tree.n_sequences % k == 0 and (tree.n_sequences // k) % sizes.pop() == 0
    out = {
        "dta": partition(tree, k, cost_model=model),
        "dta_contiguous": partition(tree, k, cost_model=model, strategy="contiguous"),
        "dta_packed": partition(tree, k, cost_model=model, strategy="packed"),
        "dta_groups": partition(tree, k, cost_model=model, group_ids=groups),
    }
    if tree.n_sequences % k == 0:  # equal counts need n divisible by k
        out["dta_equal"] = partition_for_ranks(tree, k, group_ids=groups if equal_groups else None, cost_model=model)
    out |= {
        "ffd_tokens": lpt_partition(tree, k, weight="tokens", group_ids=groups, cost_model=model),
        "ffd_tree_tokens": lpt_partition(tree, k, weight="tree_tokens", group_ids=groups, cost_model=model),
        "ffd_tokens_seq": lpt_partition(tree, k, weight="tokens", cost_model=model),
    }
    # Contiguous cut with the fewest duplicated tree tokens, balance ignored: for tree tokens, the first occurrences of
    # the parts in sorted order are k - 1 cut positions and every subtree holds at least 1 + (cuts inside it) parts,
    # so no split into k non-empty parts keeps more compression than this one.
    tokens_only = CostModel(token_cost=1.0, attention_cost=0.0, leaf_cost=0.0)
    bound = partition(tree, k, cost_model=tokens_only, strategy="contiguous", slack=1e12)
    out["max_sharing"] = rescore(bound, tree, model)
    return out


def rescore(p: Partition, tree: PrefixTree, model: CostModel) -> Partition:
    """The same parts, with costs under `model`."""
    stats = [forest_stats(tree, part) for part in p.parts]
    costs = [float(model(s.tree_tokens, s.attention_work, s.leaves, s.sequences)) for s in stats]
    return Partition(p.parts, stats, costs, p.compression_before)


def run(ks=(2, 4, 8, 16), workloads=tuple(WORKLOADS), out_dir: Path = RESULTS_DIR) -> list[dict]:
    model = CostModel()
    rows = []
    for name in workloads:
        seqs, groups = WORKLOADS[name]()
        t0 = time.perf_counter()
        tree = PrefixTree.from_sequences(seqs)
        build_s = time.perf_counter() - t0
        print(
            f"\n{name}: {tree.n_sequences} sequences, {tree.n_tokens} tokens, {tree.n_tree_tokens} tree tokens, "
            f"compression {tree.compression_ratio:.2f}x, {len(set(groups))} groups (tree built in {build_s:.2f}s)"
        )
        print(f"{'k':>3} {'method':<16} {'imbalance':>9} {'compr.':>7} {'kept':>6} {'max_cost':>11} {'mean_cost':>11}")
        for k in ks:
            t0 = time.perf_counter()
            results = methods(tree, groups, k, model)
            elapsed = time.perf_counter() - t0
            for method, p in results.items():
                row = {
                    "workload": name,
                    "k": k,
                    "method": method,
                    "imbalance": p.imbalance,
                    "compression": p.compression_after,
                    "compression_kept": p.compression_kept,
                    "max_cost": p.max_cost,
                    "mean_cost": p.mean_cost,
                }
                rows.append(row)
                print(
                    f"{k:>3} {method:<16} {p.imbalance:>9.4f} {p.compression_after:>7.3f} {p.compression_kept:>6.3f} "
                    f"{p.max_cost:>11.0f} {p.mean_cost:>11.0f}"
                )
            t0 = time.perf_counter()
            partition(tree, k, cost_model=model)
            print(f"    (dta partition alone: {1e3 * (time.perf_counter() - t0):.0f} ms; all methods {elapsed:.1f}s)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "balance.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: (f"{row[c]:.6g}" if isinstance(row[c], float) else row[c]) for c in CSV_COLUMNS})
    print("\ntarget (imbalance <= 1.05 and compression_kept >= 0.95) for dta; bound = best kept by any K-way split:")
    bounds = {(r["workload"], r["k"]): r["compression_kept"] for r in rows if r["method"] == "max_sharing"}
    for row in rows:
        if row["method"] == "dta":
            ok = row["imbalance"] <= 1.05 and row["compression_kept"] >= 0.95
            print(
                f"  {row['workload']:<14} k={row['k']:<3} {'met' if ok else 'NOT met':<8} imbalance "
                f"{row['imbalance']:.4f}, kept {row['compression_kept']:.3f} (bound "
                f"{bounds[row['workload'], row['k']]:.3f})"
            )
    return rows


def plot(csv_path: Path = RESULTS_DIR / "balance.csv", png_path: Path | None = None) -> Path:
    """Imbalance and kept compression against K, one column per workload, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    method_names = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(4.2 * len(workloads), 7.5), squeeze=False)
    for col, workload in enumerate(workloads):
        for method in method_names:
            sel = [r for r in rows if r["workload"] == workload and r["method"] == method]
            ks = [int(r["k"]) for r in sel]
            kept = [float(r["compression_kept"]) for r in sel]
            if method == "max_sharing":  # a bound on kept compression; its balance is meaningless
                axes[1][col].plot(ks, kept, color="black", linestyle=":", marker="x", label="bound (max_sharing)")
                continue
            style = {"linewidth": 2.5} if method.startswith("dta") else {"linestyle": "--"}
            axes[0][col].plot(ks, [float(r["imbalance"]) for r in sel], marker="o", label=method, **style)
            axes[1][col].plot(ks, kept, marker="o", label=method, **style)
        axes[0][col].axhline(1.05, color="red", linewidth=0.8, linestyle=":")
        axes[1][col].axhline(0.95, color="red", linewidth=0.8, linestyle=":")
        axes[0][col].set_title(workload)
        axes[0][col].set_ylabel("imbalance (max / mean cost)")
        axes[1][col].set_ylabel("compression kept (ffd_tokens_seq off scale)")
        axes[1][col].set_ylim(0.9, 1.005)
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("K (ranks)")
    axes[1][0].legend(fontsize=7)
    fig.suptitle("Partition of a global batch across K ranks (red dotted: target; default CostModel costs)")
    fig.tight_layout()
    png_path = png_path or csv_path.with_suffix(".png")
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    run(args.k, args.workloads, args.out_dir)
    print(f"plot: {plot(args.out_dir / 'balance.csv')}")


if __name__ == "__main__":
    main()

"""Engine benchmark (issue 2): dense micro-batches vs packed tree mask vs `DTAEngine.forward_backward`.

One training step = `provider.forward_backward(seqs, loss_fn)` + AdamW step, on a Qwen2-shaped model with random
weights (hidden 512, 8 layers, GQA 8/2 heads, vocab 8192, fp32 on CPU). Each (workload, method) runs in a fresh
forked process so that its peak memory is its own. Workloads:

  (a) GRPO-like: prompt 1024, 16 completions of 256 (compression 4.0x)
  (b) multi-turn agent tree, compression ~9x (4.8K-token system prompt, 2 tasks x 8 rollouts, 4 turns)
  (c) no sharing (compression 1.0x)

```
python -m benchmarks.bench_engine                    # CPU, scaled workloads (see --scale), ~10-15 min on 2 cores
python -m benchmarks.bench_engine --quick            # the quick shape and sizes of `benchmarks.run --quick`
python -m benchmarks.bench_engine --device cuda --dtype bf16 --model-shape qwen3-1.7b --scale 1
```

Writes `benchmarks/results/engine[-<tag>].csv` and `.png`. The general suite (all workloads, dense+ckpt) is
`benchmarks/run.py`; this module also defines the providers that it uses.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trl_dta.flops import dense_flops, get_model_shape, ideal_ratio, padded_dense_flops, tree_flops

from . import common, workloads
from .baselines.dense import DenseProvider, ProviderOutput
from .baselines.sparse import SparseProvider


class DTAProvider:
    """`DTAEngine.forward_backward` behind the providers' interface.

    Args:
        model ([`~transformers.PreTrainedModel`]): the policy.
        **engine_kwargs: passed to [`~trl_dta.DTAEngine`] (`max_batch_tokens`, `max_graph_tokens`, `block_size`).
    """

    def __init__(self, model, **engine_kwargs):
        from trl_dta import DTAEngine

        self.engine = DTAEngine(model, **engine_kwargs)

    def forward_backward(self, seqs, loss_fn: Callable) -> ProviderOutput:
        out = self.engine.forward_backward(seqs, loss_fn)
        return ProviderOutput(loss=float(out.loss), logps=out.logps, stats=dict(out.stats))


@dataclass
class MethodConfig:
    """Knobs of the providers (the same for every workload of a run).

    Args:
        micro_batch_size (`int`): dense rows per micro-batch.
        sparse_attention (`str`): `"blocks"` or `"mask"` (see `baselines/sparse.py`).
        sparse_max_tokens (`int`): tree tokens per packed micro-batch.
        dta_max_batch_tokens (`int`): DTA sibling-batch budget (padded tokens per forward).
        dta_max_graph_tokens (`int`, *optional*): DTA kept-graph budget (None = keep every graph) for `dta`;
            `dta-lowmem` uses `dta_lowmem_graph_tokens`.
    """

    micro_batch_size: int = field(default=1, metadata={"help": "Dense rows per micro-batch."})
    sparse_attention: str = field(default="blocks", metadata={"help": "'blocks' or 'mask'."})
    sparse_max_tokens: int = field(default=8192, metadata={"help": "Tree tokens per packed micro-batch."})
    dta_max_batch_tokens: int = field(default=8192, metadata={"help": "DTA sibling-batch budget."})
    dta_max_graph_tokens: int | None = field(default=None, metadata={"help": "DTA kept-graph budget for `dta`."})
    dta_lowmem_graph_tokens: int = field(default=1024, metadata={"help": "Kept-graph budget of `dta-lowmem`."})
    dta_block_size: int = field(default=1024, metadata={"help": "DTA recompute block."})


PROVIDERS: dict[str, Callable] = {
    "dense": lambda model, cfg: DenseProvider(model, micro_batch_size=cfg.micro_batch_size),
    "dense+ckpt": lambda model, cfg: DenseProvider(model, micro_batch_size=cfg.micro_batch_size,
                                                   gradient_checkpointing=True),
    "sparse": lambda model, cfg: SparseProvider(model, attention=cfg.sparse_attention,
                                                max_tokens=cfg.sparse_max_tokens),
    "dta": lambda model, cfg: DTAProvider(model, max_batch_tokens=cfg.dta_max_batch_tokens,
                                          max_graph_tokens=cfg.dta_max_graph_tokens, block_size=cfg.dta_block_size),
    "dta-lowmem": lambda model, cfg: DTAProvider(model, max_batch_tokens=cfg.dta_max_batch_tokens,
                                                 max_graph_tokens=cfg.dta_lowmem_graph_tokens,
                                                 block_size=cfg.dta_block_size),
}


def _warmup_seqs(seqs: list[torch.Tensor], n_tokens: int = 128) -> list[torch.Tensor]:
    """A small batch with the same kind of sharing (first sequences, truncated) to warm up kernels and threads."""
    return [s[:n_tokens] for s in seqs[:4]]


def measure(
    workload: workloads.Workload,
    method: str,
    shape: str,
    device: str = "cpu",
    dtype: str = "fp32",
    cfg: MethodConfig | None = None,
    iters: int = 1,
    min_time: float = 0.0,
    full_warmup: bool = False,
    threads: int | None = None,
    seed: int = 0,
) -> dict:
    """Time one method on one workload (call it through `common.run_isolated` for a clean peak memory).

    Returns:
        `dict`: a CSV row (ratios over other methods are filled in later by `common.fill_ratios`).
    """
    if method not in PROVIDERS:
        raise ValueError(f"unknown method {method!r}; choose from {list(PROVIDERS)}")
    cfg = cfg or MethodConfig()
    common.set_threads(threads)
    torch.manual_seed(seed)
    model = common.build_model(shape, common.parse_dtype(dtype), device, seed=seed)
    optimizer = common.make_optimizer(model)
    provider = PROVIDERS[method](model, cfg)
    seqs = workload.seqs
    tree = workload.tree()
    loss_fn = common.make_loss_fn(len(seqs), tree.n_tokens, seed)
    record: dict = {}

    def step(batch=seqs, fn=loss_fn):
        out = provider.forward_backward(batch, fn)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record.setdefault("loss", out.loss)  # the first full step's loss, before any update
        record["stats"] = out.stats

    mem = common.PeakMemory(device)
    mem.reset()
    if full_warmup:
        step()
    else:
        small = _warmup_seqs(seqs)
        step(small, common.make_loss_fn(len(small), sum(len(s) for s in small), seed))
        record.pop("loss")
    timing = common.time_steps(step, device, warmup=0, iters=iters, min_time=min_time)
    peak = max(mem.peak_mb(), 0.0)
    model_shape = get_model_shape(shape)
    if method.startswith("dense"):
        work = padded_dense_flops(tree.lengths, model_shape, cfg.micro_batch_size).total
    else:
        work = tree_flops(tree, model_shape).total
    stats = record.get("stats", {})
    return {
        "workload": workload.name,
        "method": method,
        "n_sequences": tree.n_sequences,
        "n_tokens": tree.n_tokens,
        "n_tree_tokens": tree.n_tree_tokens,
        "compression_ratio": tree.compression_ratio,
        "ideal_ratio": ideal_ratio(tree, model_shape),
        "step_s": timing.step_s,
        "median_step_s": timing.median_s,
        "loadavg": os.getloadavg()[0],
        "tokens_per_s": tree.n_tokens / timing.step_s,
        "peak_mem_mb": peak,
        "tflops": work / timing.step_s / 1e12,
        "dense_tflop": dense_flops(tree.lengths, model_shape).total / 1e12,
        "loss": record.get("loss"),
        "steps": timing.steps,
        "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
        "model_shape": model_shape.name,
        "device": device,
        "dtype": dtype,
    }


def run_grid(
    grid: list[workloads.Workload],
    methods: list[str],
    shape: str,
    device: str,
    dtype: str,
    cfg: MethodConfig,
    iters: int = 1,
    min_time: float = 0.0,
    rounds: int = 2,
    isolate: bool = True,
    threads: int | None = None,
    timeout: float | None = None,
) -> list[dict]:
    """Every method on every workload, each run in its own process; failures become rows with an `error`.

    Methods are interleaved in `rounds` rounds (round-robin over methods, a fresh process each time) and the fastest
    step over all rounds is kept: on a shared machine, load from other processes then hits every method alike.
    Peak memory is the largest over the rounds.
    """
    rows = []
    for w in grid:
        tree = w.tree()
        ideal = ideal_ratio(tree, shape)
        common.log(f"== {w.name}: {len(w.seqs)} seqs, {tree.n_tokens} tokens, {tree.n_tree_tokens} tree tokens "
                   f"({tree.compression_ratio:.2f}x), ideal {ideal:.2f}x  [{w.description}]")
        results: dict[str, list[dict]] = {m: [] for m in methods}
        errors: dict[str, str] = {}
        for r in range(rounds):
            for method in methods:
                if method in errors:
                    continue
                try:
                    row = common.run_isolated(
                        measure, w, method, shape, device, dtype, cfg, iters, min_time,
                        full_warmup=device.startswith("cuda"), threads=threads, isolate=isolate, timeout=timeout,
                    )
                    results[method].append(row)
                    common.log(f"   [{r}] {method:12s} {row['step_s']:8.2f} s/step {row['tokens_per_s']:9.0f} tok/s "
                               f"peak {row['peak_mem_mb']:8.0f} MB  loss {row['loss']:.6g}  load {row['loadavg']:.1f}")
                except RuntimeError as e:
                    msg = str(e).strip().splitlines()
                    errors[method] = msg[0] if msg else "failed"
                    common.log(f"   [{r}] {method:12s} FAILED: {errors[method]}")
                    common.log("\n".join(msg[-15:]))
        for method in methods:
            runs = results[method]
            if not runs:
                rows.append({"workload": w.name, "method": method, "n_sequences": tree.n_sequences,
                             "n_tokens": tree.n_tokens, "n_tree_tokens": tree.n_tree_tokens,
                             "compression_ratio": tree.compression_ratio, "ideal_ratio": ideal,
                             "error": errors.get(method, "failed"), "model_shape": shape, "device": device,
                             "dtype": dtype})
                continue
            best = dict(min(runs, key=lambda x: x["step_s"]))
            all_steps = sorted(x["step_s"] for x in runs)
            best["median_step_s"] = all_steps[len(all_steps) // 2]
            best["peak_mem_mb"] = max(x["peak_mem_mb"] for x in runs)
            best["loss"] = runs[0]["loss"]
            best["steps"] = sum(x["steps"] for x in runs)
            best["loadavg"] = max(x["loadavg"] for x in runs)
            rows.append(best)
    common.fill_ratios(rows)
    check_losses(rows)
    return rows


def check_losses(rows: list[dict], rtol: float = 1e-3) -> None:
    """Flag methods whose first-step loss differs from dense's: every provider computes the same loss."""
    for row in rows:
        ref = next((r for r in rows if r["workload"] == row["workload"] and r["method"] == "dense"), None)
        if ref is None or ref.get("loss") is None or row.get("loss") is None:
            continue
        if abs(row["loss"] - ref["loss"]) > rtol * max(abs(ref["loss"]), 1e-6):
            row["error"] = f"loss {row['loss']:.6g} != dense {ref['loss']:.6g}"
            common.log(f"!! {row['workload']}/{row['method']}: {row['error']}")


def engine_workloads(scale_grpo: float, scale_multi_turn: float, no_sharing: tuple[int, int], vocab_size: int):
    return [
        workloads.grpo(1024, 16, 256, scale=scale_grpo, vocab_size=vocab_size),
        workloads.multi_turn(scale=scale_multi_turn, vocab_size=vocab_size),
        workloads.no_sharing(*no_sharing, vocab_size=vocab_size),
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="quick model and sizes (as benchmarks.run --quick)")
    p.add_argument("--model-shape", default=None, help="bench-cpu (default), bench-cpu-quick with --quick, ...")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--scale", type=float, default=None,
                   help="length scale of all workloads (default: 0.5 GRPO / 0.25 multi-turn on CPU, 1 on GPU)")
    p.add_argument("--methods", default="dense,sparse,dta")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--iters", type=int, default=1, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the methods (best step kept)")
    p.add_argument("--min-time", type=float, default=0.0)
    p.add_argument("--tag", default="")
    p.add_argument("--no-isolate", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (1 avoids OpenMP oversubscription on a shared CPU)")
    args = p.parse_args(argv)

    cpu = args.device == "cpu"
    shape = args.model_shape or ("bench-cpu-quick" if args.quick else "bench-cpu")
    vocab = get_model_shape(shape).vocab_size
    if args.quick:
        grid = engine_workloads(0.25, 0.125, (8, 512), vocab)
    elif args.scale is not None:
        grid = engine_workloads(args.scale, args.scale, (16, round(2048 * args.scale)), vocab)
    elif cpu:
        grid = engine_workloads(0.5, 0.25, (8, 1024), vocab)
    else:
        grid = engine_workloads(1.0, 1.0, (16, 2048), vocab)
    cfg = MethodConfig(micro_batch_size=args.micro_batch_size)
    rows = run_grid(grid, args.methods.split(","), shape, args.device, args.dtype, cfg, args.iters, args.min_time,
                    rounds=args.rounds, isolate=not args.no_isolate, threads=args.threads)
    name = "engine" + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    path = common.write_csv(rows, f"benchmarks/results/{name}.csv")
    print(common.markdown_table(rows))
    print(f"\nwrote {path} and {common.plot(path)}")


if __name__ == "__main__":
    main()

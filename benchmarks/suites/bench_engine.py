"""Engine benchmark (issue 2): dense micro-batches vs packed tree mask vs `DTAEngine.forward_backward`.

Dense runs with `--micro-batch-size` rows per micro-batch (`dense`, one row by default) and with TRL's default
micro-batch of 8 padded rows (`dense-mb8`); speed ratios are against the faster of the two (`common.fill_ratios`).

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
python -m benchmarks.bench_engine --prefix-memory    # issue 11: prompt 4096, 4/32/128 siblings, dta-sdpa vs dta
python -m benchmarks.bench_engine --quick --families qwen,gpt_oss --workloads grpo --methods dense,dense-mb8,dta \
    --tag families                                   # GPT-OSS (sinks, MoE) beside Qwen2 of the same width
```

Writes `benchmarks/results/engine[-<tag>].csv` and `.png` (`prefix-memory[-<tag>]` with `--prefix-memory`). The
general suite (all workloads, dense+ckpt) is `benchmarks/run.py`; this module also defines the providers that it
uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trl_dta.flops import dense_flops, ideal_ratio, padded_dense_flops, tree_flops

from . import common, workloads
from .baselines.dense import DenseProvider, ProviderOutput
from .baselines.sparse import SparseProvider
from .baselines.trl_tree import TRLTreeProvider
from .oracle import ORACLE_TOL, oracle_error, oracle_logps


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
        micro_batch_size (`int`): rows per micro-batch of `dense` and `dense+ckpt` (`dense-mb8` runs
            `TRL_MICRO_BATCH_SIZE`).
        sparse_attention (`str`): `"blocks"` or `"mask"`: the attention of the method `sparse` (see
            `baselines/sparse.py`; `sparse-flex` and `sparse-blocks` name theirs).
        sparse_max_tokens (`int`, *optional*): tree tokens per packed micro-batch (None: the whole tree in one row).
        trl_token_budget (`int`, *optional*): TRL's `token_budget` of `trl-tree` (None: the whole batch in one row).
        dta_max_batch_tokens (`int`): DTA sibling-batch budget (padded tokens per forward).
        dta_max_graph_tokens (`int`, *optional*): DTA kept-graph budget (None = keep every graph) for `dta`;
            `dta-lowmem` uses `dta_lowmem_graph_tokens`.
        dta_attn_backend (`str`): attention backend of `dta` and `dta-lowmem` (`"auto"`: the engine's default).
    """

    micro_batch_size: int = field(default=1, metadata={"help": "Rows per micro-batch of `dense` and `dense+ckpt`."})
    sparse_attention: str = field(default="blocks", metadata={"help": "'blocks' or 'mask'."})
    sparse_max_tokens: int | None = field(default=None, metadata={
        "help": "Tree tokens per packed micro-batch (None: the whole tree, one row)."})
    trl_token_budget: int | None = field(default=None, metadata={
        "help": "TRL's token_budget for `trl-tree` (None: the whole batch, one row)."})
    dta_max_batch_tokens: int = field(default=8192, metadata={"help": "DTA sibling-batch budget."})
    dta_max_graph_tokens: int | None = field(default=None, metadata={"help": "DTA kept-graph budget for `dta`."})
    dta_lowmem_graph_tokens: int = field(default=1024, metadata={"help": "Kept-graph budget of `dta-lowmem`."})
    dta_block_size: int = field(default=1024, metadata={"help": "DTA recompute block."})
    dta_max_pack_tokens: int | None = field(
        default=None, metadata={"help": "DTA packed-subtree budget (None: the engine's default)."}
    )
    dta_attn_backend: str = field(default="auto", metadata={
        "help": "Attention backend of `dta` and `dta-lowmem` (`dta-<backend>` methods name theirs)."})

    def engine_kwargs(self, max_graph_tokens: int | None, attn_backend: str | None = None) -> dict:
        kwargs = dict(max_batch_tokens=self.dta_max_batch_tokens, max_graph_tokens=max_graph_tokens,
                      block_size=self.dta_block_size, attn_backend=attn_backend or self.dta_attn_backend)
        if self.dta_max_pack_tokens is not None:
            kwargs["max_pack_tokens"] = self.dta_max_pack_tokens
        return kwargs


# TRL's default micro-batch: `GRPOConfig.per_device_train_batch_size` (inherited from `TrainingArguments`, 8 in
# transformers 5.x), padded rows run together: what a user who keeps TRL's defaults gets (checkpointing aside).
TRL_MICRO_BATCH_SIZE = 8

PROVIDERS: dict[str, Callable] = {
    "dense": lambda model, cfg: DenseProvider(model, micro_batch_size=cfg.micro_batch_size),
    "dense-mb8": lambda model, cfg: DenseProvider(model, micro_batch_size=TRL_MICRO_BATCH_SIZE),
    "dense+ckpt": lambda model, cfg: DenseProvider(model, micro_batch_size=cfg.micro_batch_size,
                                                   gradient_checkpointing=True),
    # TRL's default dense path: its micro-batch and gradient checkpointing (`GRPOConfig.gradient_checkpointing=True`)
    "dense-ckpt": lambda model, cfg: DenseProvider(model, micro_batch_size=TRL_MICRO_BATCH_SIZE,
                                                   gradient_checkpointing=True),
    "sparse": lambda model, cfg: SparseProvider(model, attention=cfg.sparse_attention,
                                                max_tokens=cfg.sparse_max_tokens),
    # the packed tree under torch's FlexAttention and a block mask of the ancestor test (issue 33); on CPU training
    # takes the block loop (torch has no CPU FlexAttention backward), said in the row's `attention`
    "sparse-flex": lambda model, cfg: SparseProvider(model, attention="flex", max_tokens=cfg.sparse_max_tokens),
    "sparse-blocks": lambda model, cfg: SparseProvider(model, attention="blocks", max_tokens=cfg.sparse_max_tokens),
    # TRL's own tree packing (AsyncGRPOTrainer: TreeRow, its planner, tree_attention's signature)
    "trl-tree": lambda model, cfg: TRLTreeProvider(model, token_budget=cfg.trl_token_budget),
    "dta": lambda model, cfg: DTAProvider(model, **cfg.engine_kwargs(cfg.dta_max_graph_tokens)),
    "dta-lowmem": lambda model, cfg: DTAProvider(model, **cfg.engine_kwargs(cfg.dta_lowmem_graph_tokens)),
}
# `dta` on one named attention backend (`dta-sdpa`: the concatenating reference, the engine before issue 11).
ATTN_BACKENDS = ("sdpa", "torch", "flash", "triton")
PROVIDERS.update({
    f"dta-{name}": (lambda name: lambda model, cfg: DTAProvider(
        model, **cfg.engine_kwargs(cfg.dta_max_graph_tokens, attn_backend=name)))(name)
    for name in ATTN_BACKENDS
})


def accounting(provider, stats: dict, n_rows: int) -> dict:
    """What a method's step ran: `micro_batches`, `forwards` (model calls, each a forward and its backward),
    `forward_tokens` (dense: its padded rows; DTA: its real tokens, recomputed ones included) and `padded_tokens`
    (what the model computed, padding included), and the attention it ran."""
    if isinstance(provider, DenseProvider):
        batches = -(-n_rows // provider.micro_batch_size)
        return dict(micro_batches=batches, forwards=batches, forward_tokens=stats.get("padded_tokens"),
                    padded_tokens=stats.get("padded_tokens"), attention=stats.get("attention"))
    batches = stats.get("micro_batches", 1)  # DTA: one walk of the whole tree
    real = stats.get("forward_tokens", 0) + stats.get("recomputed_tokens", 0)
    return dict(micro_batches=batches, forwards=stats.get("forwards", batches), forward_tokens=real,
                padded_tokens=stats.get("padded_tokens", real), attention=stats.get("attention"))


class MethodRun:
    """One method on one workload: model, optimizer and provider built once, then timed steps on demand.

    Built inside a `common.Worker` process: the constructor builds everything, takes the memory baseline and runs
    one untimed warm-up step on the whole batch; `step()` times one training step (forward + backward + AdamW step)
    on the whole batch; `result()` returns the CSV row (peak memory over all steps, warm-up included).
    """

    def __init__(self, workload: workloads.Workload, method: str, shape: str, device: str = "cpu",
                 dtype: str = "fp32", cfg: MethodConfig | None = None, threads: int | None = None, seed: int = 0,
                 family: str = "qwen", reference: list[torch.Tensor] | None = None):
        if method not in PROVIDERS:
            raise ValueError(f"unknown method {method!r}; choose from {list(PROVIDERS)}")
        self.workload, self.method, self.device, self.dtype = workload, method, device, dtype
        self.cfg = cfg or MethodConfig()
        self.shape = common.model_shape(shape)
        common.set_threads(threads)
        torch.manual_seed(seed)
        self.model = common.build_model(self.shape, common.parse_dtype(dtype), device, seed=seed, family=family)
        self.optimizer = common.make_optimizer(self.model)
        self.provider = PROVIDERS[method](self.model, self.cfg)
        self.tree = workload.tree()
        self.loss_fn = common.make_loss_fn(len(workload.seqs), self.tree.n_tokens, seed)
        self.cuda = device.startswith("cuda")
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # CPU seconds of this process per step: on a loaded machine, the steadier
        self.loss = None
        self.stats: dict = {}
        self.mem = common.PeakMemory(device)
        self.mem.reset()
        # warm-up: one full step (allocator pools, kernel selection, lazily built state), not timed; its log-probs
        # (the initial weights) against the per-sequence oracle's
        out = self._step(workload.seqs, self.loss_fn)
        self.oracle_err = None if reference is None else oracle_error(out.logps, reference)

    def _step(self, seqs, loss_fn):
        out = self.provider.forward_backward(seqs, loss_fn)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def step(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        out = self._step(self.workload.seqs, self.loss_fn)
        if self.cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.times.append(dt)
        self.cpu_times.append(time.process_time() - c0)
        if self.loss is None:
            self.loss = out.loss  # the first timed step's loss (same parameters for every method)
        self.stats = {k: v for k, v in out.stats.items() if isinstance(v, (int, float, str))}
        return dt

    def _accounting(self) -> dict:
        """The oracle check, micro-batches, forwards, forwarded tokens and attention of the row."""
        tol = ORACLE_TOL[self.dtype]
        return {"oracle_err": self.oracle_err,
                "oracle_ok": None if self.oracle_err is None else int(self.oracle_err <= tol),
                **accounting(self.provider, self.stats, self.tree.n_sequences)}

    def result(self) -> dict:
        tree, times = self.tree, sorted(self.times)
        if isinstance(self.provider, DenseProvider):
            work = padded_dense_flops(tree.lengths, self.shape, self.provider.micro_batch_size).total
        else:
            work = tree_flops(tree, self.shape).total
        return {
            "workload": self.workload.name,
            "method": self.method,
            "n_sequences": tree.n_sequences,
            "n_tokens": tree.n_tokens,
            "n_tree_tokens": tree.n_tree_tokens,
            "compression_ratio": tree.compression_ratio,
            "ideal_ratio": ideal_ratio(tree, self.shape),
            "step_s": times[0],
            "median_step_s": times[len(times) // 2],
            "cpu_step_s": min(self.cpu_times),
            "steps": len(times),
            "tokens_per_s": tree.n_tokens / times[0],
            "peak_mem_mb": max(self.mem.peak_mb(), 0.0),
            "tflops": work / times[0] / 1e12,
            "dense_tflop": dense_flops(tree.lengths, self.shape).total / 1e12,
            "loss": self.loss,
            **self._accounting(),
            "stats": self.stats,
            "model_shape": self.shape.name,
            "device": self.device,
            "dtype": self.dtype,
            "loadavg": os.getloadavg()[0],
        }


def _error_row(w, tree, method, shape, device, dtype, error):
    return {"workload": w.name, "method": method, "n_sequences": tree.n_sequences, "n_tokens": tree.n_tokens,
            "n_tree_tokens": tree.n_tree_tokens, "compression_ratio": tree.compression_ratio,
            "ideal_ratio": ideal_ratio(tree, common.model_shape(shape)), "error": error, "model_shape": shape,
            "device": device, "dtype": dtype}


def run_grid(
    grid: list[workloads.Workload],
    methods: list[str],
    shape: str,
    device: str,
    dtype: str,
    cfg: MethodConfig,
    rounds: int = 2,
    interleave: bool | None = None,
    isolate: bool = True,
    threads: int | None = None,
    timeout: float | None = None,
    family: str = "qwen",
    oracle: bool = True,
) -> list[dict]:
    """Every method on every workload, each in its own process; failures become rows with an `error`.

    `oracle`: first the per-sequence oracle's log-probs (`oracle_logps`, its own process), against which each method's
    warm-up step is checked before it is timed (`oracle_ok`, `oracle_err`; a failed check also fills `error`).

    `family` builds the model of another family at the shape's width (`common.FAMILIES`); its rows' workloads are
    named `<workload>@<family>`, so that each family's methods are compared with its own dense path.

    Per workload, one `common.Worker` process per method is built (model, optimizer, warm-up); then `rounds` timed
    steps per method, interleaved round-robin across the methods (`interleave`, default on CPU: other processes'
    load then hits every method alike) or one method after the other (default on GPU, where only one model is alive
    at a time). The fastest step is kept (other processes only ever add time); the median is reported too.
    """
    interleave = (not device.startswith("cuda")) if interleave is None else interleave
    rows = []
    if family != "qwen":
        grid = [dataclasses.replace(w, name=f"{w.name}@{family}") for w in grid]
    for w in grid:
        tree = w.tree()
        common.log(f"== {w.name}: {len(w.seqs)} seqs, {tree.n_tokens} tokens, {tree.n_tree_tokens} tree tokens "
                   f"({tree.compression_ratio:.2f}x), ideal {ideal_ratio(tree, common.model_shape(shape)):.2f}x  "
                   f"[{w.description}]")
        results: dict[str, dict] = {}
        errors: dict[str, str] = {}
        reference = None
        if oracle:
            try:
                reference = common.run_isolated(oracle_logps, w, shape, device, dtype, 0, family, threads,
                                                isolate=isolate, timeout=timeout)
            except RuntimeError as e:
                common.log(f"   oracle FAILED (no oracle check): {str(e).strip().splitlines()[-1]}")

        def fail(method, e):
            msg = str(e).strip().splitlines()
            errors[method] = msg[0] if msg else "failed"
            common.log(f"   {method:12s} FAILED: {errors[method]}\n" + "\n".join(msg[-12:]))

        def start(method):
            try:
                return common.Worker(MethodRun, w, method, shape, device, dtype, cfg, threads, isolate=isolate,
                                     timeout=timeout, family=family, reference=reference)
            except RuntimeError as e:
                fail(method, e)
                return None

        def run_steps(method, worker, n):
            try:
                for _ in range(n):
                    dt = worker.call("step")
                    common.log(f"   {method:12s} {dt:8.2f} s/step {tree.n_tokens / dt:9.0f} tok/s")
                return True
            except RuntimeError as e:
                fail(method, e)
                worker.close()
                return False

        def finish(method, worker):
            try:
                results[method] = worker.call("result")
                r = results[method]
                if r.get("oracle_ok") == 0:
                    r["error"] = f"failed its oracle check: log-prob error {r['oracle_err']:.3g}"
                common.log(f"   {method:12s} best {r['step_s']:.2f} s  peak {r['peak_mem_mb']:.0f} MB  "
                           f"loss {r['loss']:.6g}  oracle {common._fmt(r.get('oracle_err'))}  "
                           f"load {r['loadavg']:.1f}")
            except RuntimeError as e:
                fail(method, e)
            worker.close()

        if interleave:
            workers = {m: start(m) for m in methods}
            workers = {m: x for m, x in workers.items() if x is not None}
            for _ in range(rounds):
                for m in list(workers):
                    if not run_steps(m, workers[m], 1):
                        del workers[m]
            for m, x in workers.items():
                finish(m, x)
        else:
            for m in methods:
                x = start(m)
                if x is not None and run_steps(m, x, rounds):
                    finish(m, x)
        for m in methods:
            rows.append(results[m] if m in results else _error_row(w, tree, m, shape, device, dtype,
                                                                   errors.get(m, "failed")))
    common.fill_ratios(rows)
    check_losses(rows)
    return rows


def check_losses(rows: list[dict], rtol: float = 1e-3) -> None:
    """Flag methods whose first-step loss differs from a plain dense variant's: every provider computes the same
    loss."""
    for row in rows:
        ref = next((r for r in rows if r["workload"] == row["workload"] and r["method"] in common.DENSE_VARIANTS
                    and r.get("loss") is not None), None)
        if ref is None or ref.get("loss") is None or row.get("loss") is None:
            continue
        if abs(row["loss"] - ref["loss"]) > rtol * max(abs(ref["loss"]), 1e-6):
            row["error"] = f"loss {row['loss']:.6g} != {ref['method']} {ref['loss']:.6g}"
            common.log(f"!! {row['workload']}/{row['method']}: {row['error']}")


# The tau2 airline per-turn trees per size (`workloads.tau2_airline`): the GPU's (1 task x 4 episodes, 36 rows,
# 205K tokens, 8.6K tree tokens, 24x); this CPU's, 1 x 2 episodes, their first 3 turns over the first 1,024 tokens
# of the shared prefix (6 rows, 8.1K tokens, 2.3K tree tokens, 3.6x); at a pretrained model's width on this CPU,
# 2 turns over 512 prefix tokens (4 rows, 2.7K tokens, 1.05K tree tokens, 2.6x).
TAU2_SIZES = {"gpu": dict(tasks=1, group=4), "cpu": dict(tasks=1, group=2, max_turns=3, prefix_tokens=1024),
              "cpu-pretrained": dict(tasks=1, group=2, max_turns=2, prefix_tokens=512)}


def engine_workloads(scale_grpo: float, scale_multi_turn: float, no_sharing: tuple[int, int], vocab_size: int,
                     tau2: str = "cpu"):
    """GRPO p1024/g16/c256, the multi-turn tree, no sharing (each at its scale) and tau2 airline (`TAU2_SIZES`)."""
    return [
        workloads.grpo(1024, 16, 256, scale=scale_grpo, vocab_size=vocab_size),
        workloads.multi_turn(scale=scale_multi_turn, vocab_size=vocab_size),
        workloads.no_sharing(*no_sharing, vocab_size=vocab_size),
        workloads.tau2_airline(vocab_size=vocab_size, **TAU2_SIZES[tau2]),
    ]


def prefix_memory(siblings=(4, 32, 128), methods=("dta-sdpa", "dta"), shape: str = "bench-cpu-quick",
                  device: str = "cpu", dtype: str = "fp32", prompt: int = 4096, completion: int = 32,
                  rounds: int = 2, threads: int | None = 1) -> list[dict]:
    """The prefix-memory case of issue 11: one `prompt`-token prompt, `siblings` completions of `completion` tokens,
    `forward_backward` (+ AdamW step) in a fresh process per run; peak memory above the model and optimizer.

    The concatenating attention (`dta-sdpa`) holds one copy of the prompt's keys/values per sibling in every layer,
    the two-part backends one in all; so the peak must grow with the siblings' own tokens only (target: 32 siblings
    within 1.5x of 4). Rows as `run_grid`'s, plus `mem_vs_first` (peak over the same method's at the fewest
    siblings)."""
    vocab = common.model_shape(shape).vocab_size
    grid = [workloads.grpo(prompt, n, completion, vocab_size=vocab) for n in siblings]
    rows = run_grid(grid, list(methods), shape, device, dtype, MethodConfig(), rounds=rounds, threads=threads,
                    oracle=False)
    for row in rows:
        first = next(r for r in rows if r["method"] == row["method"])
        if row.get("peak_mem_mb") and first.get("peak_mem_mb"):
            row["mem_vs_first"] = row["peak_mem_mb"] / first["peak_mem_mb"]
    return rows


def plot_prefix_memory(rows: list[dict], png_path) -> Path:
    """Peak memory above the model against the number of siblings, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = [(r["n_sequences"], r["peak_mem_mb"]) for r in rows if r["method"] == method and r.get("peak_mem_mb")]
        ax.plot(*zip(*points), marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("siblings (completions of the one prompt)")
    ax.set_ylabel("peak memory above the model (MB)")
    ax.set_title(f"prefix memory: {rows[0]['model_shape']}, {rows[0]['device']}, {rows[0]['dtype']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return Path(png_path)


PREFIX_MEMORY_COLUMNS = ["workload", "method", "n_sequences", "peak_mem_mb", "mem_vs_first", "step_s", "loadavg",
                         "error"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="quick model and sizes (as benchmarks.run --quick)")
    p.add_argument("--prefix-memory", action="store_true",
                   help="issue 11's case instead: prompt 4096, 4 / 32 / 128 completions of 32, `--methods` default "
                        "dta-sdpa,dta, `bench-cpu-quick` shape unless --model-shape")
    p.add_argument("--model-shape", default=None,
                   help="bench-cpu (default), bench-cpu-quick with --quick, ...; smollm2: SmolLM2-135M's real weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--scale", type=float, default=None,
                   help="length scale of all workloads (default: 0.5 GRPO / 0.25 multi-turn on CPU, 1 on GPU)")
    p.add_argument("--methods", default=None, type=common.names(PROVIDERS, "method"),
                   help="comma-separated (default: dense,dense-mb8,sparse,dta)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="rows per micro-batch of `dense` and `dense+ckpt`")
    p.add_argument("--rounds", type=int, default=3, help="timed steps per method, interleaved (best kept)")
    p.add_argument("--families", default="qwen", type=common.names(common.FAMILIES, "family"),
                   help=f"comma-separated, of {sorted(common.FAMILIES)}: each family "
                   "at the shape's width (rows `<workload>@<family>`)")
    p.add_argument("--workloads", default=None, help="comma-separated name prefixes to keep (e.g. grpo)")
    p.add_argument("--tag", default="")
    p.add_argument("--no-isolate", action="store_true")
    p.add_argument("--no-oracle", action="store_true", help="skip the per-sequence oracle check of each method")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per run on CPU (1 avoids OpenMP oversubscription on a shared machine)")
    args = p.parse_args(argv)

    cpu = args.device == "cpu"
    if args.prefix_memory:
        methods = args.methods or ["dta-sdpa", "dta"]
        rows = prefix_memory(methods=methods, shape=args.model_shape or "bench-cpu-quick", device=args.device,
                             dtype=args.dtype, rounds=args.rounds, threads=args.threads if cpu else None)
        name = "prefix-memory" + (f"-{args.tag}" if args.tag else "")
        path = common.write_csv(rows, f"benchmarks/results/{name}.csv")
        print(common.markdown_table(rows, PREFIX_MEMORY_COLUMNS))
        print(f"\nwrote {path} and {plot_prefix_memory(rows, path.with_suffix('.png'))}")
        return
    shape = args.model_shape or ("bench-cpu-quick" if args.quick else "bench-cpu")
    vocab = common.model_shape(shape).vocab_size
    pretrained = shape in common.PRETRAINED_SHAPES
    tau2 = "gpu" if not cpu else "cpu-pretrained" if pretrained else "cpu"
    if args.quick:  # a pretrained model's width on CPU: a quarter of the quick GRPO lengths
        grid = engine_workloads(1 / 16 if pretrained else 0.25, 0.125, (8, 512), vocab, tau2)
    elif args.scale is not None:
        grid = engine_workloads(args.scale, args.scale, (16, round(2048 * args.scale)), vocab, tau2)
    elif cpu:
        grid = engine_workloads(0.5, 0.25, (8, 1024), vocab, tau2)
    else:
        grid = engine_workloads(1.0, 1.0, (16, 2048), vocab, tau2)
    if args.workloads:
        prefixes = [w for w in args.workloads.split(",") if w]
        common.prefixed(p, "--workloads", prefixes, [w.name for w in grid])
        grid = [w for w in grid if w.name.startswith(tuple(prefixes))]
    cfg = MethodConfig(micro_batch_size=args.micro_batch_size)
    methods = args.methods or ["dense", "dense-mb8", "sparse", "dta"]
    rows = []
    for family in args.families:
        rows += run_grid(grid, methods, shape, args.device, args.dtype, cfg, rounds=args.rounds,
                         isolate=not args.no_isolate, threads=args.threads if cpu else None, family=family,
                         oracle=not args.no_oracle)
    name = "engine" + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    path = common.write_csv(rows, f"benchmarks/results/{name}.csv")
    print(common.markdown_table(rows, SIDE_BY_SIDE_COLUMNS))
    print(f"\nwrote {path} and {common.plot(path)}")


# The columns of the side-by-side tables (issue 33; `benchmarks/bench_side_by_side.py`).
SIDE_BY_SIDE_COLUMNS = ["workload", "method", "step_s", "median_step_s", "cpu_step_s", "steps", "peak_mem_mb",
                        "forward_tokens", "padded_tokens", "forwards", "micro_batches", "oracle_ok",
                        "speedup_vs_trl_tree", "speedup_vs_sparse_flex", "speedup_vs_dense_ckpt", "speedup_vs_dense",
                        "fraction_of_ideal", "ideal_ratio", "attention"]


if __name__ == "__main__":
    main()

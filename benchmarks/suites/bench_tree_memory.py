"""Generation memory of tree rollouts vs independent sampling: the peak key/value cache while a prompt's `G`
completions are sampled.

Two methods on the same prompt, model and budget (`max_completion_length = R`, no early end: `<eos>` suppressed, so
every completion reaches `R` tokens and every tree level is sampled):

- `independent`: TRL's generation, `model.generate` on `G` copies of the prompt (a `DynamicCache` of `G` rows of
  `P + R` keys/values);
- `tree`: `dta_tree_branching` (`trl_dta.generation.tree_sampling.sample_trees`), whose generation cache
  (`trl_dta.generation.PrefixCache`) holds the prompt once as a node the children continue, each branched segment
  once, and the rows' own tokens in a buffer.

Memory is the bytes of key/value tensors the cache holds, read after every forward (and, for the tree, after each
segment is moved into its node); transient copies while a buffer is reallocated (`torch.cat` in `DynamicCache`, a
doubling buffer in `PrefixCache`) are counted for neither. `kv_rows` is that peak over one token's key/value bytes
(`2 x layers x kv_heads x head_dim x dtype size`): the number of cached token rows.

```
python -m benchmarks.suites.bench_tree_memory    # P = 1024 and 4096, G = 8 ([2, 2, 2] and [4, 2]), R = 96, tiny model
python -m benchmarks.suites.bench_tree_memory --prompt-lens 4096 --shapes bench-cpu-quick
```

Writes `benchmarks/results/tree-memory.csv`, `.md` and `.png` (peak key/value rows per method).
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path

import torch

from trl_dta.flops import MODEL_SHAPES

from ..harness.cli import log, set_threads
from ..harness.models import build_model
from ..reporting.results import RESULTS_DIR, markdown_table, write_csv
from .bench_tree_rollouts import tiny_shape

COLUMNS = ["model_shape", "prompt_len", "group", "branching", "max_completion_length", "method", "peak_kv_bytes",
           "kv_rows", "kv_rows_vs_independent", "forward_tokens", "gen_s"]


def _row_bytes(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * next(model.parameters()).element_size()


def _dynamic_cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in getattr(cache, "layers", [])
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))


def independent(model, prompt: list[int], group: int, completion_len: int, config) -> tuple[int, int]:
    """`model.generate` on `group` copies of the prompt: (peak key/value bytes, forwarded token positions)."""
    peak, forwarded = [0], [0]

    def hook(module, args, kwargs, output):
        peak[0] = max(peak[0], _dynamic_cache_bytes(kwargs.get("past_key_values", kwargs.get("cache"))))
        ids = kwargs.get("input_ids", args[0] if args else None)
        forwarded[0] += ids.numel()

    handle = model.get_decoder().register_forward_hook(hook, with_kwargs=True)
    try:
        ids = torch.tensor([prompt] * group)
        config = copy.deepcopy(config)
        config.max_new_tokens = completion_len
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        handle.remove()
    return peak[0], forwarded[0]


def tree(model, prompt: list[int], branching: list[int], completion_len: int, config) -> tuple[int, int]:
    """Tree rollouts of the prompt: (peak key/value bytes, forwarded token positions)."""
    from trl_dta.generation.tree_sampling import sample_trees

    segment = completion_len // len(branching)
    _, stats = sample_trees(model, [prompt], branching, segment, completion_len, config, [2], 0)
    return stats.peak_kv_bytes, stats.forward_tokens


def measure(shape, prompt_len: int, branching: list[int], completion_len: int, seed: int = 0) -> list[dict]:
    from transformers import GenerationConfig

    model = build_model(shape, torch.float32, "cpu", seed=seed, max_position_embeddings=2 * prompt_len).eval()
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.config.vocab_size, (prompt_len,), generator=generator).tolist()
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=[2],
                              suppress_tokens=[2], disable_compile=True)
    group, row = math.prod(branching), _row_bytes(model)
    rows = []
    for method in ("independent", "tree"):
        torch.manual_seed(seed)
        start = time.perf_counter()
        if method == "independent":
            peak, forwarded = independent(model, prompt, group, completion_len, config)
        else:
            peak, forwarded = tree(model, prompt, branching, completion_len, config)
        rows.append({"model_shape": getattr(shape, "name", shape), "prompt_len": prompt_len, "group": group,
                     "branching": "x".join(map(str, branching)), "max_completion_length": completion_len,
                     "method": method, "peak_kv_bytes": peak, "kv_rows": peak / row, "forward_tokens": forwarded,
                     "gen_s": time.perf_counter() - start})
    for r in rows:
        r["kv_rows_vs_independent"] = r["kv_rows"] / rows[0]["kv_rows"]
    return rows


def write(rows: list[dict], stem: str) -> None:
    path = write_csv(rows, RESULTS_DIR / f"{stem}.csv", COLUMNS)
    (RESULTS_DIR / f"{stem}.md").write_text(markdown_table(rows, COLUMNS) + "\n")
    plot(rows, RESULTS_DIR / f"{stem}.png")
    log(f"wrote {path} (+ .md, .png)")


def plot(rows: list[dict], png: Path) -> None:
    """Bars: peak cached key/value rows per case and method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["model_shape"], r["prompt_len"], r["branching"]) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases) + 2), 4.5))
    for m, method in enumerate(methods):
        xs = [c + (m - (len(methods) - 1) / 2) * width for c in range(len(cases))]
        ys = [next(r["kv_rows"] for r in rows if (r["model_shape"], r["prompt_len"], r["branching"]) == case
                   and r["method"] == method) for case in cases]
        ax.bar(xs, ys, width, label=method)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{s}\nP={p}, {b}" for s, p, b in cases], fontsize=7)
    ax.set_ylabel("peak cached key/value rows (tokens)")
    ax.set_title("generation memory: tree rollouts vs independent sampling")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--branchings", nargs="+", default=["2x2x2", "4x2"], help="e.g. 2x2x2 4x2")
    parser.add_argument("--completion-len", type=int, default=96)
    parser.add_argument("--shapes", nargs="+", default=["tiny"], choices=["tiny", *MODEL_SHAPES],
                        help="`tiny` or trl_dta.flops names")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    rows = []
    for shape in args.shapes:
        for prompt_len in args.prompt_lens:
            for branching in args.branchings:
                case = measure(tiny_shape() if shape == "tiny" else shape, prompt_len,
                               [int(b) for b in branching.split("x")], args.completion_len)
                for r in case:
                    log(f"{r['model_shape']} P={prompt_len} {r['branching']} {r['method']}: peak "
                               f"{r['kv_rows']:.0f} rows ({r['kv_rows_vs_independent']:.3f} of independent), "
                               f"{r['gen_s']:.1f}s")
                rows += case
    write(rows, "tree-memory")


if __name__ == "__main__":
    main()

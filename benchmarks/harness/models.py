"""Shared benchmark plumbing: the random-weight model, the loss, timing, peak memory, isolation, CSV and plots.

Every benchmark measures *providers* (`dense`, `dense-mb8`, `dense+ckpt`, `sparse`, `dta`) that share one interface:

```python
provider = make_provider(model)                 # see benchmarks/baselines and bench_engine.PROVIDERS
loss = provider.forward_backward(seqs, loss_fn)  # adds d(sum_i loss_fn(i, logps_i, None))/d(theta) to .grad
```

with `loss_fn(i, logps_i, entropy_i)` the per-sequence loss of [`~trl_dta.DTAEngine.forward_backward`]. A training
step is `forward_backward` followed by an optimizer step, timed together.

Peak memory is measured per provider in a fresh process (`Worker` starts a child that has imported everything but run
nothing), as the peak resident set above the resident set after the model and optimizer state were built
(`/proc/self/status` VmHWM after a reset through `/proc/self/clear_refs`), or `torch.cuda.max_memory_allocated`
above the allocation at the same point on GPU.
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from trl_dta.flops import ModelShape, get_model_shape

CSV_COLUMNS = [
    "workload",
    "method",
    "n_sequences",
    "n_tokens",
    "n_tree_tokens",
    "compression_ratio",
    "ideal_ratio",
    "step_s",
    "median_step_s",
    "cpu_step_s",
    "tokens_per_s",
    "speedup_vs_dense",
    "dense_ref",
    "speedup_vs_dense_mb1",
    "speedup_vs_dense_mb8",
    "speedup_vs_sparse",
    "speedup_vs_trl_tree",
    "speedup_vs_sparse_flex",
    "speedup_vs_dense_ckpt",
    "fraction_of_ideal",
    "peak_mem_mb",
    "mem_vs_dense",
    "tflops",
    "model_shape",
    "device",
    "dtype",
    "loadavg",
    "loss",
    "oracle_ok",
    "oracle_err",
    "micro_batches",
    "forwards",
    "forward_tokens",
    "padded_tokens",
    "attention",
    "error",
]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp64": torch.float64, "float64": torch.float64, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


# ---------------------------------------------------------------------------------------------------- model


# Shapes built from a pretrained checkpoint instead of random weights: name -> (its shape, `trl_dta.pretrained` key).
# `smollm2`: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9/3 heads, vocab 49,152, tied embeddings).
PRETRAINED_SHAPES = {"smollm2": (ModelShape(576, 1536, 30, 9, 3, 64, 49152, name="smollm2"), "smollm2-135m-instruct")}


def model_shape(shape: str | ModelShape) -> ModelShape:
    """`trl_dta.flops.get_model_shape`, and the pretrained shapes of `PRETRAINED_SHAPES`."""
    if isinstance(shape, str) and shape in PRETRAINED_SHAPES:
        return PRETRAINED_SHAPES[shape][0]
    return get_model_shape(shape)


def _pretrained(shape: ModelShape, dtype, device, attn_implementation: str):
    """The real weights of a `PRETRAINED_SHAPES` shape (converted once, cached: `trl_dta.pretrained`), in train mode."""
    from transformers import AutoModelForCausalLM

    from trl_dta.pretrained import pretrained_folder

    model = AutoModelForCausalLM.from_pretrained(pretrained_folder(PRETRAINED_SHAPES[shape.name][1]), dtype=dtype,
                                                 attn_implementation=attn_implementation).to(device)
    got = ModelShape.from_config(model.config, name=shape.name)
    if got != shape:
        raise ValueError(f"{shape.name}: the checkpoint has the shape {got}, not {shape}")
    return model.train()


def _gpt_oss_config(shape: ModelShape, common: dict):
    """GPT-OSS at `shape`'s width: attention sinks, sliding (window 128) and full layers alternating, 4 experts of
    half the shape's MLP width with 2 routed per token (so the active MLP FLOPs are the shape's), its eager attention
    (transformers has no SDPA one for its sinks) and its router loss coefficient."""
    from transformers import GptOssConfig

    return GptOssConfig(**{**common, "attn_implementation": "eager"}, intermediate_size=shape.intermediate_size // 2,
                        num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
                        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "rope_theta": 150000.0,
                                         "original_max_position_embeddings": common["max_position_embeddings"] // 32})


def _qwen_config(shape: ModelShape, common: dict):
    from transformers import Qwen2Config, Qwen3Config

    return (Qwen3Config if shape.name.startswith("qwen3") else Qwen2Config)(
        **common, intermediate_size=shape.intermediate_size, tie_word_embeddings=True)


# Model families of the benchmarks at a `ModelShape`'s width: family -> config builder (`build_model(family=...)`).
FAMILIES: dict[str, Callable] = {"qwen": _qwen_config, "gpt_oss": _gpt_oss_config}


def build_model(
    shape: str | ModelShape,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    max_position_embeddings: int = 32768,
    family: str = "qwen",
):
    """A causal LM of `shape` with random weights, in train mode: Qwen2-shaped (Qwen3-shaped for `qwen3-*` shapes),
    or another family of `FAMILIES` at the same width; a hybrid shape (`recurrent_layers > 0`) builds a Qwen3.5 text
    model (Gated DeltaNet) or a Nemotron-H (Mamba2), `_hybrid_config`.

    Args:
        shape (`str` or [`~trl_dta.flops.ModelShape`]): the model's shape (a name of `trl_dta.flops.MODEL_SHAPES`, or
            of `PRETRAINED_SHAPES`: the pretrained model's real weights, `seed` and `family` unused).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): parameter dtype.
        device (`str`, *optional*, defaults to `"cpu"`): where the parameters live.
        seed (`int`, *optional*, defaults to `0`): initialisation seed (the global RNG is left untouched).
        attn_implementation (`str`, *optional*, defaults to `"sdpa"`): attention backend of the dense path.
        max_position_embeddings (`int`, *optional*, defaults to `32768`): longest position (RoPE table).
        family (`str`, *optional*, defaults to `"qwen"`): one of `FAMILIES`.
    """
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    shape = model_shape(shape)
    if shape.name in PRETRAINED_SHAPES:
        if family != "qwen":
            raise ValueError(f"shape {shape.name!r} loads its own pretrained model; drop family={family!r}")
        return _pretrained(shape, dtype, device, attn_implementation)
    if shape.recurrent_layers:
        config = _hybrid_config(shape, max_position_embeddings, attn_implementation, dtype)
    else:
        common = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
                      num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                      head_dim=shape.head_dim, max_position_embeddings=max_position_embeddings,
                      attn_implementation=attn_implementation, dtype=dtype)
        config = FAMILIES[family](shape, common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config).to(dtype)
    return model.train()


def _hybrid_config(shape: ModelShape, max_position_embeddings: int, attn_implementation: str, dtype):
    """The transformers config of a hybrid `shape`: Gated DeltaNet as Qwen3.5 lays it out (three linear-attention
    layers, then a full-attention one), Mamba2 as Nemotron-H (`M` Mamba2, `-` MLP, `*` attention blocks: Mamba2 and
    MLP alternating, the attention blocks last)."""
    from transformers import NemotronHConfig, Qwen3_5TextConfig

    common = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                  num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                  num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
                  attn_implementation=attn_implementation, dtype=dtype)
    if shape.recurrent_kind == "gated_deltanet":
        kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(shape.num_layers)]
        config = Qwen3_5TextConfig(**common, layer_types=kinds, linear_num_value_heads=shape.recurrent_heads,
                                   linear_num_key_heads=shape.recurrent_groups,
                                   linear_key_head_dim=shape.recurrent_key_dim,
                                   linear_value_head_dim=shape.recurrent_value_dim,
                                   linear_conv_kernel_dim=shape.conv_kernel)
    else:
        pattern = "".join("M-"[i % 2] for i in range(shape.recurrent_layers + shape.n_mlp_layers))
        pattern += "*" * shape.n_attention_layers
        config = NemotronHConfig(**common, hybrid_override_pattern=pattern, mamba_num_heads=shape.recurrent_heads,
                                 mamba_head_dim=shape.recurrent_value_dim, ssm_state_size=shape.recurrent_key_dim,
                                 n_groups=shape.recurrent_groups, conv_kernel=shape.conv_kernel,
                                 chunk_size=shape.chunk_size)
    got = ModelShape.from_config(config, name=shape.name)
    if got != shape:
        raise ValueError(f"{shape.name}: the built config has the shape {got}, not {shape}")
    return config


def make_optimizer(model) -> torch.optim.Optimizer:
    """AdamW with its state already allocated (so that peak-memory deltas hold activations only)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, foreach=False)
    for p in params:
        state = opt.state[p]
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return opt


def make_loss_fn(n_sequences: int, n_tokens: int, seed: int = 0) -> Callable:
    """A GRPO-like per-sequence loss: `-A_i * sum_t logp_i[t] / n_tokens` with fixed random advantages `A_i`.

    The same function is given to every provider, so that their losses and gradients are comparable.
    """
    gen = torch.Generator().manual_seed(seed)
    advantages = torch.randn(n_sequences, generator=gen, dtype=torch.float64).tolist()
    scale = 1.0 / max(n_tokens, 1)

    def loss_fn(i: int, logps: torch.Tensor, entropy: torch.Tensor | None = None) -> torch.Tensor:
        return logps.sum() * (-advantages[i] * scale)

    return loss_fn


# ---------------------------------------------------------------------------------------------------- memory


class PeakMemory:
    """Peak memory above a baseline, in MiB: CUDA allocator peak on GPU, resident-set high-water mark on CPU.

    Call `reset()` at the baseline; `peak_mb()` afterwards returns the peak since then minus the baseline.
    """

    def __init__(self, device: str):
        self.cuda = str(device).startswith("cuda")
        self.base = 0

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} missing from /proc/self/status")

    def reset(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        _trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
        self.base = self._status("VmRSS")

    def peak_mb(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.base) / 2**20
        return (self._status("VmHWM") - self.base) / 2**20


def _trim() -> None:
    """Give freed heap memory back to the OS (glibc), so that the next peak is measured from a clean baseline."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------------------------- isolation


def _serve(conn, factory, args, kwargs):
    """Child side of `Worker`: build the object, then answer method calls until told to stop."""
    try:
        obj = factory(*args, **kwargs)
        conn.send(("ok", None))
    except BaseException as e:  # report any failure to the parent, with its traceback
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        conn.close()
        return
    while True:
        try:
            name, call_args = conn.recv()
        except EOFError:
            break
        if name is None:
            break
        try:
            conn.send(("ok", getattr(obj, name)(*call_args)))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    conn.close()


START_METHODS = ("fork", "forkserver", "spawn")


def start_method() -> str:
    """How `Worker` starts its child: `$DTA_BENCH_START_METHOD` if set, else `fork` with a CPU-only torch build and
    `forkserver` with a CUDA build.

    A forked child inherits the imported modules (no import time per run) but cannot use CUDA once the parent has
    touched it: `torch.cuda.is_available()` alone makes later forks fail with "Cannot re-initialize CUDA in forked
    subprocess". A fork server is a fresh interpreter (started by exec, so the parent's CUDA state does not reach it)
    that imports the preloaded modules once and forks every child from itself: CUDA-safe, and no import per run.
    `spawn` imports everything per child.
    """
    method = os.environ.get("DTA_BENCH_START_METHOD")
    if method is None:
        return "fork" if torch.version.cuda is None else "forkserver"
    if method not in START_METHODS:
        raise ValueError(f"DTA_BENCH_START_METHOD must be one of {START_METHODS}, got {method!r}")
    return method


def _context(method: str, preload: Sequence[str]):
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":  # the server imports these once; its children fork from it (the first call starts it)
        ctx.set_forkserver_preload(["torch", "transformers", __name__, *(m for m in preload if m != "__main__")])
    return ctx


class Worker:
    """An object living in a child process, driven by method calls from the parent.

    Each benchmark run (one method on one workload) gets its own process, so that its peak memory is its own, and
    several of them can stay alive side by side so that their steps can be interleaved (round-robin), which spreads
    interference from other processes on a shared machine evenly over the methods. The child starts as
    [`start_method`] says (or `start`): with `fork` the parent must not have run any torch computation before
    (OpenMP thread pools do not survive a fork) nor touched CUDA; `forkserver` and `spawn` need the factory and its
    arguments picklable (a fork server imports the factory's module and the `preload` modules once). With
    `isolate=False` the object lives in-process (debugging).

    Raises:
        `RuntimeError`: with the child's traceback when construction or a call failed, or the child died or timed
            out.
    """

    def __init__(self, factory: Callable, *args, isolate: bool = True, timeout: float | None = None,
                 start: str | None = None, preload: Sequence[str] = (), **kwargs):
        self.isolate, self.timeout, self.proc, self.obj = isolate, timeout, None, None
        if not isolate:
            self.obj = factory(*args, **kwargs)
            return
        ctx = _context(start or start_method(), (factory.__module__, *preload))
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, factory, args, kwargs), daemon=True)
        self.proc.start()
        child.close()
        self._answer()

    def _answer(self):
        if not self.conn.poll(self.timeout):
            self.close(wait=0)  # busy past its time: killed at once (a deadline is near)
            raise RuntimeError(f"benchmark worker timed out after {self.timeout} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.proc.join(1)
            code = self.proc.exitcode
            self.close()
            raise RuntimeError(f"benchmark worker died (exit code {code}; -9 is usually out of memory)") from None
        if status == "error":
            self.close()
            raise RuntimeError(value)
        return value

    def submit(self, name: str, *args) -> None:
        """Start the call `name(*args)` without waiting; [`result`] returns its answer (workers run side by side)."""
        if not self.isolate:
            self._pending = getattr(self.obj, name)(*args)
            return
        if self.proc is None:
            raise RuntimeError("benchmark worker is closed")
        try:
            self.conn.send((name, args))
        except OSError:  # the child is gone (killed: often the kernel's OOM killer)
            self.proc.join(1)
            code = self.proc.exitcode
            self.close(wait=0)
            raise RuntimeError(f"benchmark worker died (exit code {code}; -9 is usually out of memory)") from None

    def result(self):
        """The answer of the call [`submit`] started (raises as [`call`] does)."""
        return self._pending if not self.isolate else self._answer()

    def call(self, name: str, *args):
        self.submit(name, *args)
        return self.result()

    def close(self, wait: float = 10) -> None:
        """Stop the child: ask it to end, and kill it if it has not within `wait` seconds."""
        if self.proc is None:
            self.obj = None
            return
        try:
            self.conn.send((None, ()))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(wait)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
        self.proc = None


def start_isolated(fn: Callable, *args, isolate: bool = True, timeout: float | None = None, **kwargs) -> Worker:
    """Start `fn(*args, **kwargs)` in a child process (see [`Worker`]); `.result()` waits for its picklable result,
    then `.close()` the worker. Several started at once run side by side."""
    worker = Worker(_Call, fn, args, kwargs, isolate=isolate, timeout=timeout, preload=(fn.__module__,))
    worker.submit("run")
    return worker


def run_isolated(fn: Callable, *args, isolate: bool = True, timeout: float | None = None, **kwargs):
    """Run `fn(*args, **kwargs)` in a child process (see [`Worker`]) and return its picklable result."""
    worker = start_isolated(fn, *args, isolate=isolate, timeout=timeout, **kwargs)
    try:
        return worker.result()
    finally:
        worker.close()


class _Call:
    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def run(self):
        return self.fn(*self.args, **self.kwargs)


# ---------------------------------------------------------------------------------------------------- results


# Plain dense variants (no checkpointing) and their own speed-up columns. The reference of `speedup_vs_dense` and
# `fraction_of_ideal` is the fastest of them on each workload (`dense_ref` names it): a method is never credited with
# beating a dense setup that a user would not run.
DENSE_VARIANTS = {"dense": "speedup_vs_dense_mb1", "dense-mb8": "speedup_vs_dense_mb8"}


def fill_ratios(rows: list[dict]) -> list[dict]:
    """Add speed-ups over dense, `sparse`, `trl-tree`, `sparse-flex` and `dense-ckpt`, fraction of ideal and memory
    relative to dense, per workload.

    `speedup_vs_dense` and `fraction_of_ideal` are against the fastest plain dense variant (`DENSE_VARIANTS`) that ran
    on the workload, `speedup_vs_dense_mb1` / `speedup_vs_dense_mb8` against each variant, and `mem_vs_dense` against
    the variant with the smallest peak memory (the one-row `dense` when both ran): both references are the ones least
    favourable to the other methods.
    """
    by_workload: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_workload.setdefault(row["workload"], {})[row["method"]] = row
    for methods in by_workload.values():
        dense = [methods[m] for m in DENSE_VARIANTS if methods.get(m, {}).get("tokens_per_s")]
        fastest = max(dense, key=lambda r: r["tokens_per_s"], default=None)
        leanest = min((r for r in dense if r.get("peak_mem_mb") is not None), key=lambda r: r["peak_mem_mb"],
                      default=None)
        refs = {"speedup_vs_dense": fastest, "speedup_vs_sparse": methods.get("sparse"),
                "speedup_vs_trl_tree": methods.get("trl-tree"), "speedup_vs_sparse_flex": methods.get("sparse-flex"),
                "speedup_vs_dense_ckpt": methods.get("dense-ckpt")}
        refs.update({key: methods.get(m) for m, key in DENSE_VARIANTS.items()})
        for row in methods.values():
            tps = row.get("tokens_per_s")
            for key, ref in refs.items():
                row[key] = tps / ref["tokens_per_s"] if ref and ref.get("tokens_per_s") and tps else None
            row["dense_ref"] = fastest["method"] if fastest else None
            speedup = row["speedup_vs_dense"]
            row["fraction_of_ideal"] = speedup / row["ideal_ratio"] if speedup and row.get("ideal_ratio") else None
            mem = row.get("peak_mem_mb")
            row["mem_vs_dense"] = (
                mem / leanest["peak_mem_mb"] if leanest and leanest["peak_mem_mb"] and mem is not None else None
            )
    return rows


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return f"{value:.6g}"
    return str(value)


def write_csv(rows: list[dict], path: str | Path, columns: Sequence[str] = CSV_COLUMNS) -> Path:
    """Write rows with `columns` (the fixed `CSV_COLUMNS` by default; missing values empty)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(row.get(k)) for k in columns})
    return path


def read_csv(path: str | Path) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for k, v in row.items():
            if k in ("workload", "method", "dense_ref", "model_shape", "device", "dtype", "error"):
                continue
            try:
                row[k] = float(v) if v != "" else None
            except ValueError:
                pass
    return rows


def markdown_table(rows: list[dict], columns: Sequence[str] | None = None) -> str:
    """Rows as a GitHub markdown table."""
    columns = list(columns or [
        "workload", "method", "n_tokens", "n_tree_tokens", "ideal_ratio", "tokens_per_s", "speedup_vs_dense",
        "dense_ref", "speedup_vs_sparse", "fraction_of_ideal", "peak_mem_mb", "mem_vs_dense",
    ])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for c in columns:
            v = row.get(c)
            if isinstance(v, float) and c in ("n_tokens", "n_tree_tokens", "n_sequences"):
                v = int(v)
            elif isinstance(v, float):
                v = f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
            cells.append("" if v is None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(csv_path: str | Path, png_path: str | Path | None = None) -> Path:
    """Bar chart of tokens/s per workload and method (log scale), with the ideal speed-up marked over the fastest dense
    variant (`dense_ref`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_csv(csv_path) if r.get("tokens_per_s")]
    png_path = Path(png_path or Path(csv_path).with_suffix(".png"))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(workloads) + 2), 4.5))
    for m, method in enumerate(methods):
        xs, ys = [], []
        for w, workload in enumerate(workloads):
            for r in rows:
                if r["workload"] == workload and r["method"] == method:
                    xs.append(w + (m - (len(methods) - 1) / 2) * width)
                    ys.append(r["tokens_per_s"])
        ax.bar(xs, ys, width, label=method)
    for w, workload in enumerate(workloads):
        dense = [r for r in rows if r["workload"] == workload and r["method"] == (r.get("dense_ref") or "dense")]
        if dense and dense[0].get("ideal_ratio"):
            ideal = dense[0]["tokens_per_s"] * dense[0]["ideal_ratio"]
            ax.hlines(ideal, w - 0.45, w + 0.45, colors="black", linestyles="dashed")
    ax.set_yscale("log")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("training tokens / s (rollout tokens)")
    ax.set_title(f"{Path(csv_path).stem}: dashed = fastest dense x ideal FLOP ratio")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def names(known: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """An argparse `type` for a comma-separated list of names, each one of `known`.

    An unknown name (or an empty list) fails the parse before anything runs: argparse exits with status 2 and a message
    naming the flag, the unknown names and the known ones, instead of a run that measures nothing.

    Args:
        known (sequence of `str`): the accepted names (methods, workloads, shapes).
        what (`str`): what a name is, for the message (`"method"`, `"workload"`).
    """
    known = list(known)

    def parse(text: str) -> list[str]:
        items = [name for name in text.split(",") if name]
        unknown = [name for name in items if name not in known]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown or text!r}; choose from {known}")
        return items

    return parse


def prefixed(parser: argparse.ArgumentParser, flag: str, prefixes: Sequence[str], names: Sequence[str]) -> None:
    """Fail the parse (`parser.error`, status 2) when a prefix of `flag` selects none of `names`, naming the known
    ones."""
    unknown = [p for p in prefixes if not any(name.startswith(p) for name in names)]
    if unknown:
        parser.error(f"argument {flag}: no name starts with {unknown}; choose from {list(names)}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def set_threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

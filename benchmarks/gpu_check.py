"""The Python steps of `benchmarks/gpu_check.sh`: environment, per-backend engine correctness, per-backend benchmarks.

```
python -m benchmarks.gpu_check env                 # versions, GPU, which attention backends run here
python -m benchmarks.gpu_check correctness         # every backend vs the fp32 oracle, fp32 and bf16
python -m benchmarks.gpu_check bench-small         # per backend at qwen3-1.7b (bf16); bench-large: qwen3-8b
python -m benchmarks.gpu_check bench-memory        # issue 11's prefix-memory case at qwen3-8b
python -m benchmarks.gpu_check all --dry-run       # the same on CPU with tiny shapes (checks the script itself)
```

**Correctness.** Per model family (Qwen2: GQA; Qwen3: q/k norms; Mistral: sliding window; Gemma 2: soft-capping
and window) and per attention backend, `DTAEngine.forward_backward` on a multi-turn tree (packed subtree rows and
walked segments) against the per-sequence dense oracle in float32 (TF32 off): log-probs and every parameter
gradient, as relative errors (to the largest reference value). fp32 passes at `FP32_TOL`; bf16 (the same weights
rounded) passes when DTA's error is at most `2 x` the dense bf16 path's error `+ 1e-3`, the rule of the op-level
test (`tests/kernels/test_two_part.py`): different exact kernels round differently, neither may be much worse.

**Benchmarks.** `benchmarks.run`'s grid (one fresh process per method and workload, bf16, one timed step after a
warm-up) with `dense-mb8` (TRL's default micro-batch) and `dta-<backend>` for every backend that runs here: GRPO
1024 x 16, multi-turn 9x and no-sharing (full sizes) at `qwen3-1.7b`; GRPO 4096 x 8 and multi-turn at `qwen3-8b`;
and issue 11's prefix-memory case (prompt 4096, 4 / 32 / 128 completions of 32; `dta-sdpa` against `dta`) at
`qwen3-8b`. CSV/PNG/markdown under `benchmarks/results/`. Running out of GPU memory is a result (the `dta-sdpa`
reference holds the prompt's keys/values once per sibling: 0.6 GB each at 8B), shown in the error column; any other
error fails the step.

Fails loudly: no CUDA (without `--dry-run`), a missing package, a failed check: a non-zero exit and a line saying
what. flash-attn not installed: its backend is skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

RESULTS = Path("benchmarks/results")
FP32_TOL = 1e-4


def _say(msg: str) -> None:
    print(msg, flush=True)


def device_of(dry_run: bool) -> torch.device:
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("FAIL: no CUDA device (torch.cuda.is_available() is False); run with --dry-run on a CPU.")
    return torch.device("cuda")


def backends_here(device: torch.device) -> list[str]:
    """The concrete attention backends that run on `device`, with a line for each one skipped."""
    from trl_dta.kernels import available_backends

    here = available_backends(device)
    why = {"flash": "flash-attn >= 2.7 not installed (pip install 'flash-attn>=2.7' --no-build-isolation)"
                    if importlib.util.find_spec("flash_attn") is None else "flash-attn does not load on this device",
           "triton": "triton not installed" if importlib.util.find_spec("triton") is None else
                     "triton needs CUDA (or TRITON_INTERPRET=1 on CPU)"}
    for name in ("sdpa", "torch", "flash", "triton"):
        if name not in here:
            _say(f"SKIP backend {name}: {why.get(name, 'not available')}")
    return here


def env(args) -> None:
    import transformers
    import trl

    _say(f"python {sys.version.split()[0]}  torch {torch.__version__} (cuda {torch.version.cuda})  "
         f"transformers {transformers.__version__}  trl {trl.__version__}")
    for name in ("triton", "flash_attn"):
        spec = importlib.util.find_spec(name)
        _say(f"{name}: {'installed' if spec else 'not installed'}")
    device = device_of(args.dry_run)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        _say(f"GPU {props.name}, {props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}")
    _say(f"attention backends on {device.type}: {backends_here(device)}")


# ---------------------------------------------------------------------------------------------- correctness


def _family_model(family: str, dtype: torch.dtype, device, tiny: bool):
    """A small model of `family` with random weights (perturbed norms), stock attention for the dense path."""
    import transformers

    dims = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=256) if tiny else \
        dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             vocab_size=1024)
    common = dict(num_hidden_layers=2, max_position_embeddings=4096, tie_word_embeddings=False, **dims)
    window = 24 if tiny else 96  # shorter than the sequences, so windows cut into the path
    configs = {
        "qwen2": (transformers.Qwen2Config, {}),
        "qwen3": (transformers.Qwen3Config, {}),
        "mistral": (transformers.MistralConfig, dict(sliding_window=window)),
        "gemma2": (transformers.Gemma2Config, dict(sliding_window=window, query_pre_attn_scalar=dims["head_dim"],
                                                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    }
    cls, extra = configs[family]
    config = cls(**common, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager" if family == "gemma2" else "sdpa")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    return model.to(device=device, dtype=dtype).eval()


def _oracle(model, seqs, loss_fn):
    """Per-sequence dense forward/backward: log-probs (float32) and parameter gradients (float32)."""
    model.zero_grad(set_to_none=True)
    logps = []
    for i, s in enumerate(seqs):
        logits = model(input_ids=s[None]).logits[0, :-1].float()  # (len - 1, vocab)
        lp = torch.log_softmax(logits, -1).gather(-1, s[1:, None])[:, 0]
        loss_fn(i, lp).backward()
        logps.append(lp.detach())
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logps, grads


def _errors(logps, grads, ref_logps, ref_grads) -> tuple[float, float]:
    """Largest relative errors of the log-probs and of any parameter gradient (relative to the reference's max)."""
    lp = max(((a.float() - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()
             for a, b in zip(logps, ref_logps) if b.numel())
    g = max(((grads[n] - r).abs().max() / r.abs().max().clamp(min=1e-12)).item() for n, r in ref_grads.items())
    return lp, g


def _dta(model, backend, seqs, loss_fn, **engine_kw):
    from trl_dta import DTAEngine

    model.zero_grad(set_to_none=True)
    out = DTAEngine(model, attn_backend=backend, **engine_kw).forward_backward(seqs, loss_fn)
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.logps, grads


def correctness(args) -> bool:
    from benchmarks import common, workloads

    device = device_of(args.dry_run)
    backends = backends_here(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sizes = dict(system_len=40, task_len=6, turn_len=8) if args.dry_run else dict(system_len=300, task_len=20,
                                                                                  turn_len=40)
    ok = True
    for family in ("qwen2", "qwen3", "mistral", "gemma2"):
        model32 = _family_model(family, torch.float32, device, args.dry_run)
        vocab = model32.config.vocab_size
        w = workloads.multi_turn(n_tasks=2, group=4, turns=2, distinct=(2, 4), vocab_size=vocab, **sizes)
        seqs = [s.to(device) for s in w.seqs]
        loss_fn = common.make_loss_fn(len(seqs), w.n_tokens)
        ref_lp, ref_g = _oracle(model32, seqs, loss_fn)
        model16 = copy.deepcopy(model32).to(torch.bfloat16)
        dense16 = _errors(*_oracle(model16, seqs, loss_fn), ref_lp, ref_g)
        _say(f"{family:8s} dense bf16        logp err {dense16[0]:.2e}  grad err {dense16[1]:.2e}")
        for backend in backends:
            # The Triton interpreter (CPU) has no bf16 and is slow: there Triton runs fp32, packed rows only.
            interpreted = backend == "triton" and device.type == "cpu"
            for pack in (1024,) if interpreted else (1024, 0):  # packed subtree rows, then every segment walked
                err32 = _errors(*_dta(model32, backend, seqs, loss_fn, max_pack_tokens=pack), ref_lp, ref_g)
                good32 = max(err32) <= FP32_TOL
                line = (f"{family:8s} {backend:6s} pack={pack:<4d} fp32 logp {err32[0]:.2e} grad {err32[1]:.2e} "
                        f"{'OK' if good32 else 'FAIL'} | ")
                good16 = True
                if interpreted:
                    line += "bf16 skipped (Triton interpreter: no bf16)"
                else:
                    err16 = _errors(*_dta(model16, backend, seqs, loss_fn, max_pack_tokens=pack), ref_lp, ref_g)
                    good16 = all(e <= 2 * d + 1e-3 for e, d in zip(err16, dense16))
                    line += f"bf16 logp {err16[0]:.2e} grad {err16[1]:.2e} {'OK' if good16 else 'FAIL'}"
                ok &= good32 and good16
                _say(line)
        del model32, model16
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _say("correctness: " + ("OK" if ok else "FAIL"))
    return ok


# ---------------------------------------------------------------------------------------------- benchmarks


def _failures(rows: list[dict]) -> list[str]:
    """Errors other than running out of memory (a measurement: `dta-sdpa` holds a prompt copy per sibling)."""
    return [f"{r['workload']}/{r['method']}: {r['error']}" for r in rows
            if r.get("error") and "out of memory" not in r["error"].lower()]


def _bench_setup(dry_run: bool):
    """Shapes, workloads, prefix-memory sizes, dtype and file stem of the benchmark steps."""
    from benchmarks import workloads
    from trl_dta.flops import ModelShape, get_model_shape

    if dry_run:
        tiny = ModelShape(64, 96, 2, 4, 2, 16, 256, name="gpu-check-dry")
        return dict(shapes={"small": tiny, "large": tiny},
                    suites={"small": [workloads.grpo(48, 4, 12, vocab_size=256),
                                      workloads.multi_turn(scale=0.02, vocab_size=256)],
                            "large": [workloads.grpo(64, 3, 8, vocab_size=256)]},
                    memory=dict(siblings=(2, 8), prompt=128, completion=8), dtype="fp32", name="gpu-check-dry")
    full = workloads.suite("full", vocab_size=32768)
    return dict(shapes={"small": get_model_shape("qwen3-1.7b"), "large": get_model_shape("qwen3-8b")},
                suites={"small": workloads.by_name(full, ["grpo-p1024-g16-c256", "multiturn-9x", "no-sharing"]),
                        "large": workloads.by_name(full, ["grpo-p4096-g8-c512", "multiturn-9x"])},
                memory=dict(siblings=(4, 32, 128), prompt=4096, completion=32), dtype="bf16", name="gpu-check")


def _bench_suite(args, size: str) -> bool:
    from benchmarks import common
    from benchmarks.bench_engine import MethodConfig, run_grid

    device = device_of(args.dry_run)
    setup = _bench_setup(args.dry_run)
    shape = setup["shapes"][size]
    methods = ["dense-mb8"] + [f"dta-{name}" for name in backends_here(device)]
    start = time.perf_counter()
    rows = run_grid(setup["suites"][size], methods, shape, device.type, setup["dtype"], MethodConfig(), rounds=1,
                    threads=1 if args.dry_run else None)
    path = common.write_csv(rows, RESULTS / f"{setup['name']}-{size}-{shape.name}.csv")
    _say(f"\n{shape.name}, {setup['dtype']}, {time.perf_counter() - start:.0f} s -> {path}, {common.plot(path)}")
    _say(common.markdown_table(rows))
    return _report("bench-" + size, _failures(rows))


def bench_memory(args) -> bool:
    """Issue 11's prefix-memory case at the large shape: the reference (`dta-sdpa`) against the default (`dta`)."""
    from benchmarks import common
    from benchmarks.bench_engine import PREFIX_MEMORY_COLUMNS, plot_prefix_memory, prefix_memory

    device = device_of(args.dry_run)
    setup = _bench_setup(args.dry_run)
    start = time.perf_counter()
    rows = prefix_memory(methods=["dta-sdpa", "dta"], shape=setup["shapes"]["large"], device=device.type,
                         dtype=setup["dtype"], rounds=1, threads=1 if args.dry_run else None, **setup["memory"])
    path = common.write_csv(rows, RESULTS / f"{setup['name']}-prefix-memory.csv")
    _say(f"\nprefix memory at {setup['shapes']['large'].name}, {time.perf_counter() - start:.0f} s -> {path}, "
         f"{plot_prefix_memory(rows, path.with_suffix('.png'))}")
    _say(common.markdown_table(rows, PREFIX_MEMORY_COLUMNS))
    return _report("bench-memory", _failures(rows))


def _report(step: str, failures: list[str]) -> bool:
    _say(f"{step}: " + ("OK" if not failures else "FAIL\n  " + "\n  ".join(failures)))
    return not failures


STEPS = {"env": env, "correctness": correctness, "bench-small": lambda args: _bench_suite(args, "small"),
         "bench-large": lambda args: _bench_suite(args, "large"), "bench-memory": bench_memory}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=[*STEPS, "all"])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: check the script, not the GPU")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.dry_run and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend runs in the interpreter
    steps = list(STEPS) if args.step == "all" else [args.step]
    failed = [s for s in steps if STEPS[s](args) is False]
    if failed:
        raise SystemExit(f"FAIL: {failed}")


if __name__ == "__main__":
    main()

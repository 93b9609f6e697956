"""The checking steps of `benchmarks/gpu/check.sh`: the environment, per-backend engine correctness, and the dry run's
stand-in for the GPU machine's Python image.

```
python -m benchmarks.gpu.check env                       # versions, the GPU, which attention backends run here
python -m benchmarks.gpu.check correctness --out DIR     # every backend vs the float64 oracle: correctness.csv
python -m benchmarks.gpu.check device-image DIR          # the dry run: DIR = this environment's packages that the
                                                         # GPU machine's image has (benchmarks/gpu/image.txt)
```

**Correctness.** Per model family (Qwen2: GQA; Qwen3: q/k norms; Mistral: sliding window; Gemma 2: soft-capping and
window) and attention backend, `DTAEngine.forward_backward` on a multi-turn tree, as packed subtree rows
(`max_pack_tokens=1024`) and as walked segments (`0`), against the per-sequence dense oracle: the same weights in
float64 with the RMSNorms computed in float64 (`tests/conftest.py::use_input_dtype_norms`; stock norms compute in
float32 even in a float64 model). Measured: the log-probs and all parameter gradients, each as one relative L2 error
(`tests/bounds.py::relative_l2`), and the same for the dense path (`model(...)` per sequence) in the same precision.
The bars are the test suite's (`tests/bounds.py`, whose docstrings derive them):

- `fp64` (the engine, its dispatch and the exact `math` parts on the device): DTA's error <= `FP64_TOL`, the suite's
  float64 exactness bound. Not Gemma 2, whose eager attention runs its softmax in float32 whatever the dtype.
- `fp32` (TF32 off) and `bf16-autocast` over float32 weights (TRL's default precision): DTA's error within
  `forward_slack(n)` (log-probs) and `gradient_slack(m, n)` (gradients, `m` the most sequences sharing a token) times
  the dense path's.

On CUDA the `torch` and `triton` backends run float32 and float64 parts on the exact `math` kernel (`triton_parts`,
`torch_parts`), bf16 parts on their fused kernels. The dry run (CPU, Triton interpreted) rehearses: every precision
and Triton on Mistral, bf16 autocast on the other families, packed rows only.

Fails loudly: no CUDA (without `--dry-run`), a check over its bar: a non-zero exit and a line saying what. Backends
that cannot run here (flash-attn not installed) are skipped with a line saying why.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import importlib.metadata
import importlib.util
import io
import os
import sys
from pathlib import Path

import torch

FP64_TOL = 1e-10
# The families checked (model types of `trl_dta.modeling.families.FAMILIES`) and what each exercises beyond GQA:
# (head_dim, window) -> config fields; a window shorter than the sequences, so that it cuts into the path.
CASES = {
    "qwen2": lambda head_dim, window: {},
    "qwen3": lambda head_dim, window: {},  # q/k norms
    "mistral": lambda head_dim, window: dict(sliding_window=window),
    "gemma2": lambda head_dim, window: dict(sliding_window=window, query_pre_attn_scalar=head_dim,
                                            final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
}
FAMILIES = tuple(CASES)
FLOAT32_SOFTMAX = {"gemma2"}  # eager attention with a float32 softmax: no float64 oracle
COLUMNS = ["family", "backend", "max_pack_tokens", "precision", "logp_err", "grad_err", "dense_logp_err",
           "dense_grad_err", "logp_ratio", "grad_ratio", "bar", "ok", "device"]
# Carried to the GPU machine as wheels (benchmarks/gpu/requirements.txt): the versions the package is tested with.
REQUIRED = {"transformers": "5.24", "trl": "1.16"}
# Imported by the env step: every baseline row needs them (TRL's fused head imports `trl.trainer.utils`, which pulls
# in datasets (pyarrow, fsspec) and peft), so a version mismatch on the device image fails here, in seconds.
IMPORTED = ("datasets", "trl.trainer.utils", "peft", "trl.experimental.async_grpo.packing")


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
    why = {"flash": "flash-attn not installed (it is never built here: carry a prebuilt wheel in .whl/ to use it)"
                    if importlib.util.find_spec("flash_attn") is None else "flash-attn's ops do not load here",
           "triton": "triton not installed" if importlib.util.find_spec("triton") is None else
                     "triton needs CUDA (or TRITON_INTERPRET=1 on CPU)"}
    for name in ("sdpa", "torch", "flash", "triton"):
        if name not in here:
            _say(f"SKIP backend {name}: {why.get(name, 'not available')}")
    return here


def env(args) -> bool:
    """Versions and where each package was imported from; the GPU; the backends. False if a pin is not met."""
    import transformers
    import trl

    ok = True
    _say(f"python {sys.version.split()[0]}  torch {torch.__version__} (CUDA {torch.version.cuda})")
    for name in ("transformers", "trl", "datasets", "accelerate", "peft", "triton", "flash_attn", "pyarrow", "fsspec",
                 "tokenizers", "huggingface_hub"):
        spec = importlib.util.find_spec(name)
        try:
            version = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            version = getattr(sys.modules.get(name), "__version__", "?") if spec else None
        where = Path(spec.origin).parent.parent if spec and spec.origin else None
        _say(f"  {name:16s} {version or 'not installed':12s} {where or ''}")
    for name in IMPORTED:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # an import error, or a version check of a dependency
            _say(f"FAIL: import {name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
            ok = False
            continue
        top = name.split(".")[0]
        _say(f"  import {name:36s} ok ({top} {getattr(sys.modules[top], '__version__', '?')}, "
             f"{Path(module.__file__).parent})")
    for name, minimum in REQUIRED.items():
        version = {"transformers": transformers.__version__, "trl": trl.__version__}[name]
        if tuple(int(x) for x in version.split(".")[:2]) < tuple(int(x) for x in minimum.split(".")):
            _say(f"FAIL: {name} {version} < {minimum}: the carried wheels were not installed first on the path")
            ok = False
    device = device_of(args.dry_run)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        _say(f"GPU {props.name}, {props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}, "
             f"{props.multi_processor_count} SMs; TF32 matmul {torch.backends.cuda.matmul.allow_tf32}")
    _say(f"attention backends on {device.type}: {backends_here(device)}")
    return ok


# ---------------------------------------------------------------------------------------------- correctness


def _family_model(family: str, device, tiny: bool):
    """A small model of `family` (a model type of the package's families table, `FAMILIES`) in float64 with random
    weights (perturbed norms, so their gradients matter), the same weights at every call; the family's own feature
    switched on (`CASES`)."""
    import transformers

    from trl_dta.modeling.families import family_of

    dims = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=256) if tiny else \
        dict(hidden_size=512, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             vocab_size=1024)
    common = dict(num_hidden_layers=2, max_position_embeddings=4096, tie_word_embeddings=False, **dims)
    config = transformers.AutoConfig.for_model(family, **common, **CASES[family](dims["head_dim"], 24 if tiny else 96))
    if not family_of(config).tested:
        raise ValueError(f"{family} is not a tested family of trl_dta.modeling.families.FAMILIES")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager" if family in FLOAT32_SOFTMAX else "sdpa")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    return model.to(device=device, dtype=torch.float64).eval()


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _dense(model, seqs, loss_fn, autocast: bool):
    """The per-sequence dense path (`tests/reference.py`; the oracle in float64): log-probs and parameter gradients."""
    from tests.reference import dense_forward_backward

    model.zero_grad(set_to_none=True)
    with torch.autocast(seqs[0].device.type, dtype=torch.bfloat16, enabled=autocast):
        _, logps, _ = dense_forward_backward(model, seqs, loss_fn, entropy=False)
    return [lp.double() for lp in logps], _grads(model)


def _dta(model, backend, seqs, loss_fn, autocast: bool, **engine_kw):
    from trl_dta import DTAEngine

    model.zero_grad(set_to_none=True)
    engine = DTAEngine(model, attn_backend=backend, **engine_kw)
    with torch.autocast(seqs[0].device.type, dtype=torch.bfloat16, enabled=autocast):
        out = engine.forward_backward(seqs, loss_fn)
    return [lp.double() for lp in out.logps], _grads(model)


def _errors(logps, grads, ref_logps, ref_grads) -> tuple[float, float]:
    """Relative L2 errors of the log-probs (all sequences together) and of the gradients (all parameters)."""
    from tests.bounds import relative_l2

    return relative_l2(logps, ref_logps), relative_l2([grads[n] for n in ref_grads], list(ref_grads.values()))


def _bar(precision: str, err, dense, n: tuple[int, int], sharing: int) -> tuple[list, bool, str]:
    """`(ratios to the dense path, passed, the bar as text)`; `n`: the log-probs and gradient values compared."""
    from tests.bounds import forward_slack, gradient_slack

    if precision == "fp64":  # the dense float64 path is the oracle itself
        return [None, None], max(err) <= FP64_TOL, f"<= {FP64_TOL:g}"
    slacks = (forward_slack(n[0]), gradient_slack(sharing, n[1]))
    ratios = [e / d if d > 0 else (0.0 if e == 0 else float("inf")) for e, d in zip(err, dense)]
    return ratios, all(r <= k for r, k in zip(ratios, slacks)), f"<= {slacks[0]:.2f}x / {slacks[1]:.2f}x dense"


def _cases(family: str, backends: list[str], dry_run: bool):
    """`(precision, autocast, backend, max_pack_tokens)` checked for a family."""
    precisions = [("fp32", False), ("bf16-autocast", True)]
    if family not in FLOAT32_SOFTMAX:
        precisions.insert(0, ("fp64", False))
    # The dry run checks the script: every precision and the (slow) Triton interpreter on one family, packed rows.
    rehearsal = dry_run and family != "mistral"
    for precision, autocast in precisions[-1:] if rehearsal else precisions:
        for backend in backends:
            if rehearsal and backend == "triton":
                continue
            for pack in (1024,) if dry_run else (1024, 0):
                yield precision, autocast, backend, pack


def check_family(family: str, backends: list[str], dry_run: bool, path: Path) -> list[dict]:
    """Every case of `family` (see the module docstring): one row each, printed and appended to `path` (CSV, its
    header already written) as it is measured."""
    from tests.bounds import max_sharing
    from tests.conftest import use_input_dtype_norms

    from .. import workloads
    from ..harness.models import make_loss_fn

    device = device_of(dry_run)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sizes = dict(system_len=40, task_len=6, turn_len=8) if dry_run else dict(system_len=300, task_len=20, turn_len=40)
    exact = use_input_dtype_norms(_family_model(family, device, dry_run))  # the oracle, and the fp64 runs
    models = {"fp64": exact, "fp32": _family_model(family, device, dry_run).to(torch.float32)}
    models["bf16-autocast"] = models["fp32"]
    w = workloads.multi_turn(n_tasks=2, group=4, turns=2, distinct=(2, 4), vocab_size=exact.config.vocab_size,
                             **sizes)
    seqs = [s.to(device) for s in w.seqs]
    loss_fn = make_loss_fn(len(seqs), w.n_tokens)
    ref = _dense(exact, seqs, loss_fn, autocast=False)
    n = (sum(lp.numel() for lp in ref[0]), sum(g.numel() for g in ref[1].values()))
    sharing = max_sharing(seqs)
    dense, rows = {}, []
    for precision, autocast, backend, pack in _cases(family, backends, dry_run):
        model = models[precision]
        if precision not in dense:
            dense[precision] = _errors(*_dense(model, seqs, loss_fn, autocast), *ref)
            _say(f"{family:8s} dense  {precision:13s} logp err {dense[precision][0]:.2e}  "
                 f"grad err {dense[precision][1]:.2e}")
        err = _errors(*_dta(model, backend, seqs, loss_fn, autocast, max_pack_tokens=pack), *ref)
        ratios, good, bar = _bar(precision, err, dense[precision], n, sharing)
        vs = ["" if r is None else f" ({r:.2f}x dense)" for r in ratios]
        _say(f"{family:8s} {backend:6s} {precision:13s} pack={pack:<4d} logp {err[0]:.2e}{vs[0]} grad "
             f"{err[1]:.2e}{vs[1]} [{bar}] {'OK' if good else 'FAIL'}")
        rows.append(dict(family=family, backend=backend, max_pack_tokens=pack, precision=precision, logp_err=err[0],
                         grad_err=err[1], dense_logp_err=dense[precision][0], dense_grad_err=dense[precision][1],
                         logp_ratio=ratios[0], grad_ratio=ratios[1], bar=bar, ok=int(good), device=device.type))
        _append(path, rows[-1])
    return rows


def correctness(args) -> bool:
    """`check_family` for every family, `--jobs` of them side by side (each compiles its own Triton variants)."""
    from ..harness.isolation import start_isolated

    backends = backends_here(device_of(args.dry_run))
    jobs = args.jobs or (1 if args.dry_run else len(FAMILIES))
    path = Path(args.out) / "correctness.csv"
    if not path.exists():  # the header once, before the families' processes append their rows
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(",".join(COLUMNS) + "\n")
    ok = True
    for start in range(0, len(FAMILIES), jobs):
        running = [start_isolated(check_family, family, backends, args.dry_run, path, isolate=jobs > 1)
                   for family in FAMILIES[start:start + jobs]]
        for family, worker in zip(FAMILIES[start:start + jobs], running):
            try:
                rows = worker.result()
            except RuntimeError as e:  # the family's process failed: say so, go on with the others
                _say(f"FAIL {family}: " + "\n".join(str(e).strip().splitlines()[-15:]))
                ok, rows = False, []
            finally:
                worker.close()
            ok &= all(row["ok"] for row in rows)
    _say(f"correctness: {'OK' if ok else 'FAIL'} -> {path}")
    return ok


def _append(path: Path, row: dict) -> None:
    """One row in one write (processes append side by side)."""
    line = io.StringIO()
    csv.DictWriter(line, fieldnames=COLUMNS).writerow(
        {k: ("" if v is None else f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()})
    with open(path, "a", newline="") as f:
        f.write(line.getvalue())


# ---------------------------------------------------------------------------------------------- the dry run's image


def device_image(args) -> bool:
    """Link into `args.dir` the packages of this environment that the GPU machine's image has (a name per line in
    `benchmarks/gpu/image.txt`), with their metadata, and what this environment's versions of them require (their
    versions can differ from the image's), never the packages the GPU machine gets as wheels
    (`benchmarks/gpu/requirements.txt`). A `.pth` file naming that folder then gives a fresh environment the GPU
    machine's packages, so that the dry run's install must supply the rest exactly as there."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    def names_in(path):
        return [line.split("==")[0].strip() for line in Path(path).read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    carried = {canonicalize_name(n) for n in names_in(Path(args.image_list).with_name("requirements.txt"))}
    todo, seen, linked = list(names_in(args.image_list)), set(), []
    dest = Path(args.dir)
    dest.mkdir(parents=True, exist_ok=True)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name in carried:
            continue
        seen.add(name)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        tops = {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")
                and not f.parts[0].endswith(".pth")}
        for top in tops:
            source, target = Path(dist.locate_file(top)), dest / top
            if source.exists() and not target.exists():
                target.symlink_to(source)
        linked.append(name)
    _say(f"device image: {len(linked)} packages linked into {dest} (the image's {len(names_in(args.image_list))} "
         f"names that exist here, with their requirements; not {sorted(carried)})")
    return True


STEPS = {"env": env, "correctness": correctness, "device-image": device_image}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=list(STEPS))
    p.add_argument("dir", nargs="?", help="device-image: the folder to fill")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: check the script, not the GPU")
    p.add_argument("--out", default="benchmarks/results/gpu-check", help="correctness: where correctness.csv goes")
    p.add_argument("--jobs", type=int, default=None, help="correctness: families side by side (GPU: all, CPU: 1)")
    p.add_argument("--image-list", default=str(Path(__file__).with_name("image.txt")))
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.dry_run and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend runs in the interpreter
    if STEPS[args.step](args) is False:
        raise SystemExit(f"FAIL: {args.step}")


if __name__ == "__main__":
    # Run from the importable module, so that `check_family` pickles as `benchmarks.gpu.check.check_family`.
    from benchmarks.gpu.check import main as _main

    _main()

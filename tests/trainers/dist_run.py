"""One training run for the distributed tests, launched with `accelerate launch` (or plain `python` for one process).

Every rank generates and scores with TRL's own `_generate_and_score_completions` (its collectives run as usual), then
its rows are replaced by a slice of one fixed global batch (seeded prompts, completions of varied lengths, advantages,
`num_items_in_batch` recomputed), so that runs with different process counts train on the same global batch: sampling
itself differs between process counts (each rank draws from its own generator). The final trainable parameters are
saved by rank 0.

Under FSDP (`accelerate launch --use_fsdp --fsdp_version 2 ...`) the CPU upgrade of `cpu_engines.py` makes the sharding
real; `--variants` then trains several configurations one after the other in one launch (`VARIANTS`: TRL's trainer,
DTA's defaults, DTA walking every segment), each from the saved model, into `<out stem>-<variant>.pt`.

`--precision` is `make_args`'s (`fp64`: `bf16=False`, the model loaded in float64, a hybrid model with its recurrences'
float32 casts removed, `hybrid_models.float64_internals`; `fp32`: `bf16=False`; `trl`: TRL's default `bf16=True`),
`name@fp32` a variant in another precision (accelerate's state is reset in between); every run records and asserts
the dtypes its optimizer steps really ran in (`run_probes.py`: `PrecisionProbe`, `assert_precision`; accelerate maps
bf16 differently per engine).

    accelerate launch --multi_gpu --num_processes 2 tests/trainers/dist_run.py --out a.pt --trainer grpo --dta 1
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from accelerate import PartialState

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/: `bounds` (the trainers' conftest), hybrid_models
from conftest import LEARNING_RATE, PAD, PRECISIONS, build_tokenizer, make_args  # noqa: E402
from cpu_engines import (  # noqa: E402
    CollectiveCounter,
    Zero3Probe,
    assert_fsdp2,
    enable_cpu_engines,
)
from run_probes import (  # noqa: E402
    PrecisionProbe,
    StepMemory,
    StepParams,
    assert_deepspeed,
    assert_precision,
    current_rss_mb,
    full,
    initial_values,
    peak_rss_mb,
)

GROUPS, G, PROMPT, COMPLETION = 4, 4, (10, 24), (1, 7)
SPLIT_COMPRESSION = 3.2  # between the two ranks' forest compressions on the fixed batch (`dta_layer_split`)
# `--variants`: the `dta_*` settings of each (`trl`: TRL's trainer). `_walk`: every segment its own engine call
# (`dta_max_pack_tokens=0`), so that a step runs many forward and backward calls.
VARIANTS = {
    "trl": {},
    "dta": {},
    "dta_walk": {"dta_max_pack_tokens": 0},
    # FSDP2's per-layer schedule; `_small`: batches of at most 48 padded tokens, so that the ranks' forests need
    # different numbers of batches and the lockstep pads with idle ones.
    "dta_layer": {"dta_fsdp_schedule": "layer"},
    "dta_layer_small": {"dta_fsdp_schedule": "layer", "dta_max_batch_tokens": 48},
    # The fixed batch's forests compress 3.31x on rank 0 and 3.08x on rank 1: alone, rank 0 would run DTA and rank 1
    # TRL's dense path; the per-layer schedule has both agree (both dense), or their layers' collectives would not pair.
    "dta_layer_split": {"dta_fsdp_schedule": "layer", "dta_min_compression": SPLIT_COMPRESSION},
    # ZeRO-3 over a budget of 0 MiB: decoder layers gathered by DeepSpeed's hooks, the ranks in lockstep (`_small`: in
    # several row batches, unequal across ranks)
    "dta_zero3_layer": {"dta_zero3_gather_budget_mb": 0},
    "dta_zero3_layer_small": {"dta_zero3_gather_budget_mb": 0, "dta_max_batch_tokens": 48},
    # every window and scoring call below the compression threshold: TRL's dense path inside DTA's optimizer windows
    "dta_dense": {"dta_min_compression": 1e9},
}


class EngineCalls:
    """Every engine call's stats on this rank (`DTAEngine._call` wrapped, the real call unchanged): whether it
    trained, whether it ran in lockstep with the other ranks, and its counters."""

    def __init__(self):
        from trl_dta.engine.core import DTAEngine

        self.calls: list[dict] = []
        self._cls, self._original = DTAEngine, DTAEngine._call
        calls, original = self.calls, self._original

        def _call(engine, seqs, **kwargs):
            out = original(engine, seqs, **kwargs)
            calls.append({"train": kwargs["loss_fn"] is not None, "lockstep": kwargs.get("lockstep") is not None,
                          **{k: v for k, v in out.stats.items() if k != "seconds"}})
            return out

        DTAEngine._call = _call

    def close(self) -> None:
        self._cls._call = self._original


def fixed_batch(vocab: int, device) -> dict:
    """The global generation batch: `GROUPS` prompts (left-padded) x `G` completions (right-padded)."""
    g = torch.Generator().manual_seed(1234)
    rows = GROUPS * G
    p_len = torch.randint(*PROMPT, (GROUPS,), generator=g).repeat_interleave(G)
    c_len = torch.randint(*COMPLETION, (rows,), generator=g)
    pw, cw = PROMPT[1], COMPLETION[1]
    prompt_ids = torch.full((rows, pw), PAD)
    prompt_mask = torch.zeros(rows, pw, dtype=torch.long)
    completion_ids = torch.full((rows, cw), PAD)
    completion_mask = torch.zeros(rows, cw, dtype=torch.long)
    prompts = [torch.randint(3, vocab, (PROMPT[1],), generator=g) for _ in range(GROUPS)]
    # Groups 0 and 2 (on ranks 0 and 1 in TRL's layout) share their first tokens: the balancer should put them
    # together, which moves rows between ranks.
    prompts[2][: PROMPT[0] - 1] = prompts[0][: PROMPT[0] - 1]
    p_len[2 * G : 3 * G] = p_len[0]
    for r in range(rows):
        p, c = int(p_len[r]), int(c_len[r])
        prompt_ids[r, pw - p :] = prompts[r // G][:p]
        prompt_mask[r, pw - p :] = 1
        completion_ids[r, :c] = torch.randint(3, vocab, (c,), generator=g)
        completion_mask[r, :c] = 1
    advantages = torch.randn(rows, generator=g)
    return {
        "prompt_ids": prompt_ids.to(device),
        "prompt_mask": prompt_mask.to(device),
        "completion_ids": completion_ids.to(device),
        "completion_mask": completion_mask.to(device),
        "advantages": advantages.to(device),
        "num_items_in_batch": completion_mask.sum().to(device),
    }


def with_fixed_batch(cls):
    class Fixed(cls):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            n = len(out["prompt_ids"])
            rank = self.accelerator.process_index
            fixed = fixed_batch(len(self.processing_class), self.accelerator.device)
            assert n * self.accelerator.num_processes == GROUPS * G, (n, self.accelerator.num_processes)
            for key, value in fixed.items():
                out[key] = value if value.ndim == 0 else value[rank * n : (rank + 1) * n]
            # Old-policy log-probs of the (new) completions under the current policy: RLOO's sequence sums, and
            # GRPO's per-token values when a generation feeds several optimizer steps.
            old_keys = [k for k in ("old_logps", "old_per_token_logps") if out.get(k) is not None]
            if old_keys:
                ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
                mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
                with torch.no_grad():
                    per_token, _, _ = self._get_per_token_logps_and_entropies(
                        self.model, ids, mask, out["completion_ids"].size(1)
                    )
                if "old_logps" in old_keys:
                    out["old_logps"] = (per_token * out["completion_mask"]).sum(1)
                if "old_per_token_logps" in old_keys:
                    out["old_per_token_logps"] = per_token
                fixed = {**fixed, **dict.fromkeys(old_keys)}
            if out.get("ref_per_token_logps") is not None:  # GRPO with beta > 0: the reference's, as TRL scores it
                out["ref_per_token_logps"] = reference_logps(self, out)
                fixed = {**fixed, "ref_per_token_logps": None}
            stale = [k for k, v in out.items() if k not in fixed and isinstance(v, torch.Tensor)]
            assert not stale, f"entries computed from the sampled completions would be stale: {stale}"
            return out

    return Fixed


def reference_logps(trainer, out: dict) -> torch.Tensor:
    """The reference model's per-token log-probs of `out`'s completions, through the trainer's scoring hook as TRL's
    `_generate_and_score_completions` computes them (its reference model, or the policy with the adapter off)."""
    from trl.trainer.utils import use_adapter

    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    keep = out["completion_ids"].size(1)
    with torch.no_grad():
        if trainer.ref_model is not None:
            return trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, keep)[0]
        model = trainer.accelerator.unwrap_model(trainer.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--trainer", choices=["grpo", "rloo"], default="grpo")
    parser.add_argument("--dta", type=int, default=1)
    parser.add_argument("--peft", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (a reference model when > 0)")
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--cost_model", default="default")
    parser.add_argument("--spg", type=int, default=2, help="steps_per_generation")
    parser.add_argument("--ga", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--variants", default="", help=f"comma-separated, of {list(VARIANTS)} (overrides --dta); "
                        "`name@fp32` / `name@trl`: that variant in that precision; `name:trainer=rloo:peft=1`: with "
                        "these arguments of this script instead of the command line's")
    parser.add_argument("--expect", default="", help="fsdp2 or deepspeed: assert that this engine really ran")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="make_args's: fp64, fp32 or trl (bf16=True)")
    parser.add_argument("--learning_rate", type=float, default=LEARNING_RATE)
    parser.add_argument("--max_grad_norm", type=float, default=None, help="TrainingArguments' (unset: its default)")
    parser.add_argument("--zero_config", default="",
                        help="JSON merged into DeepSpeed's `zero_optimization` (e.g. a persistence threshold)")
    parser.add_argument("--per_step", type=int, default=0, help="1: save the trainable parameters after every step")
    parser.add_argument("--optim", default="sgd", help="TrainingArguments' `optim` (the tests compare SGD updates)")
    parser.add_argument("--ds3_gather_for_generation", type=int, default=1,
                        help="TRL's `ds3_gather_for_generation` (0: ZeRO-3 generation gathers module by module)")
    parser.add_argument("--save", type=int, default=0, help="1: `trainer.save_model` into `ckpt-<out stem>` at the end")
    parser.add_argument("--refused", default="", help="comma-separated variants whose trainer must refuse the setting "
                        "at construction: the error's type and message are saved instead of a run")
    args = parser.parse_args()
    enable_cpu_engines()
    if not args.variants:
        train_one(args, args.dta, {}, args.out)
        return
    variants, precision = args.variants.split(","), None
    for variant in variants:
        out = Path(args.out).with_name(f"{Path(args.out).stem}-{variant}.pt")
        name, *overrides = variant.split(":")  # `dta:trainer=rloo:peft=1`: this script's arguments for the variant
        name, _, own = name.partition("@")  # `trl@fp32`: the variant in another precision than `--precision`
        if precision is not None and (own or args.precision) != precision:
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state()  # accelerate fixes the precision once per state (the gloo group stays)
        precision = own or args.precision
        settings = dict(_setting(args, item) for item in overrides)
        run_args = argparse.Namespace(**{**vars(args), **settings, "precision": precision})
        if variant in args.refused.split(","):
            refused_at_construction(run_args, VARIANTS[name], out)
            continue
        with float64_internals_of(run_args):
            train_one(run_args, int(name != "trl"), VARIANTS[name], out, last=variant == variants[-1])


def _setting(args, item: str) -> tuple[str, object]:
    """A variant's `name=value`, typed as the argument's default (a number where it defaults to None)."""
    name, value = item.split("=", 1)
    if not hasattr(args, name):
        raise ValueError(f"a variant sets `{name}`, which is not an argument of this script")
    default = getattr(args, name)
    return name, float(value) if default is None else type(default)(value)


def float64_internals_of(args):
    """`fp64` runs of a hybrid model: its recurrences' float32 casts removed (`hybrid_models.float64_internals`)."""
    import contextlib

    from transformers import AutoConfig

    from hybrid_models import HYBRID_FAMILIES, float64_internals

    model_type = AutoConfig.from_pretrained(args.model_dir).model_type
    if args.precision != "fp64" or model_type not in HYBRID_FAMILIES:
        return contextlib.nullcontext()
    return float64_internals(model_type)


def refused_at_construction(args, extra: dict, out) -> None:
    """A DTA trainer built with `extra` must raise at construction (on every rank); rank 0 saves what it raised."""
    try:
        train_one(args, 1, extra, out, construct_only=True)
    except (ValueError, NotImplementedError) as exc:
        if PartialState().is_main_process:
            torch.save({"refused": type(exc).__name__, "message": str(exc)}, out)
        return
    raise AssertionError(f"{extra}: the trainer was built, but should have been refused")


def train_one(args, dta: int, extra: dict, out, last: bool = True, construct_only: bool = False) -> None:
    from datasets import Dataset

    if args.trainer == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        from trl_dta import DTAGRPOConfig, DTAGRPOTrainer

        cls, config_cls = (DTAGRPOTrainer, DTAGRPOConfig) if dta else (GRPOTrainer, GRPOConfig)
    else:
        from trl import RLOOConfig, RLOOTrainer

        from trl_dta import DTARLOOConfig, DTARLOOTrainer

        cls, config_cls = (DTARLOOTrainer, DTARLOOConfig) if dta else (RLOOTrainer, RLOOConfig)
    tokenizer = build_tokenizer()
    dataset = Dataset.from_dict({"prompt": [f"prompt number {i}: a+b=" for i in range(GROUPS * 4)]})
    per_device = GROUPS * G // (args.spg * args.processes)  # `spg` micro-batches per generation, any process count
    extra = {**extra, "dta_cost_model": args.cost_model} if dta else {}  # otherwise DTA's defaults
    config = make_args(
        config_cls,
        Path(out).parent / f"run-{Path(out).stem}",
        args.steps,
        args.precision,
        per_device_train_batch_size=per_device,
        steps_per_generation=args.spg,
        gradient_accumulation_steps=args.ga,
        num_generations=G,
        max_completion_length=4,
        beta=args.beta,  # > 0: reference log-probs recomputed for the fixed completions (`reference_logps`)
        learning_rate=args.learning_rate,
        **({} if args.max_grad_norm is None else {"max_grad_norm": args.max_grad_norm}),
        # fp64 (make_args loads the model in float64): MoE experts in their eager loop (the grouped matmul has none)
        model_init_kwargs={"experts_implementation": "eager"} if args.precision == "fp64" else None,
        **({} if args.ds3_gather_for_generation else {"ds3_gather_for_generation": False}),
        optim=args.optim,
        **extra,
    )
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    trainer = with_fixed_batch(cls)(
        model=args.model_dir,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    if construct_only:
        return
    if args.zero_config:  # read when DeepSpeed wraps the model, at `train()`
        import json

        trainer.accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"].update(
            json.loads(args.zero_config))
    counter = CollectiveCounter()
    counter.count_training(trainer)
    engine_calls = EngineCalls()
    probe = PrecisionProbe(trainer)
    state = PartialState()  # initialised by the trainer (use_cpu=True: a gloo group on CPU)
    assert state.num_processes == args.processes, f"expected {args.processes} processes, got {state.num_processes}"
    initial = initial_values(trainer.model)
    rss_before_train = current_rss_mb()
    step_memory = StepMemory(trainer)
    zero3 = Zero3Probe(trainer) if dta and trainer._dta_parallel.name == "deepspeed" and \
        trainer._dta_parallel.stage == 3 else None
    per_step = StepParams(trainer) if args.per_step else None
    try:
        trainer.train()
    finally:
        engine_calls.close()
    checkpoint = None
    if args.save:  # collective under ZeRO-3 (the 16-bit weights gathered)
        checkpoint = str(Path(out).parent / f"ckpt-{Path(out).stem}")
        trainer.save_model(checkpoint)
    if dta and args.cost_model == "fit":
        model = trainer._dta_cost_model
        assert model.fixed_cost > 0 or model.token_cost != 1.0, f"the cost model was not refitted: {model}"
    if args.expect == "fsdp2":
        assert_fsdp2(trainer)
    elif args.expect == "deepspeed":
        assert_deepspeed(trainer)
    elif args.processes > 1:  # DDP on CPU: accelerate's MULTI_CPU over gloo, not a silent one-process run
        from accelerate.utils import DistributedType

        assert trainer.accelerator.distributed_type == DistributedType.MULTI_CPU, trainer.accelerator.distributed_type
    if dta:
        assert trainer._dta_parallel.name == (args.expect or ("ddp" if args.processes > 1 else "local"))
    model = trainer.accelerator.unwrap_model(trainer.model)
    groups = list({id(g): g for m in model.modules() if hasattr(m, "_get_fsdp_state")  # a grouped unit: once
                   for g in m._get_fsdp_state()._fsdp_param_groups if g.fsdp_params}.values())
    ran = probe.result(trainer)
    assert_precision(ran, args.precision, args.expect)
    from trl_dta.parallel.fsdp2 import decoder_layers

    layers = decoder_layers(model)
    layer_groups = [g for m in model.modules() if id(m) in layers for g in m._get_fsdp_state()._fsdp_param_groups]
    counts = {**counter.counts, "groups": len(groups),
              "trainable_groups": sum(any(p.sharded_param.requires_grad for p in g.fsdp_params) for g in groups),
              "layer_groups": len(layer_groups),
              "trainable_layer_groups": sum(any(p.sharded_param.requires_grad for p in g.fsdp_params)
                                            for g in layer_groups)}
    from accelerate.utils import gather_object

    engine_calls_per_rank = gather_object([engine_calls.calls])  # collective: every rank's list
    memory = gather_object([{"before_train_mb": rss_before_train, "peak_mb": peak_rss_mb(),
                             **step_memory.result()}])  # per rank
    # Collective under FSDP, and for DeepSpeed's float32 master weights of a bf16 module.
    params = {n: full(p, trainer.is_deepspeed_enabled) for n, p in model.named_parameters() if p.requires_grad}
    if state.is_main_process:
        logs = [e for e in trainer.state.log_history if "loss" in e]
        torch.save({"params": params, "logs": logs, "collectives": counts, "steps": args.steps,
                    "zero3": zero3.result() if zero3 is not None else None, "checkpoint": checkpoint,
                    "memory": memory,
                    "step_params": per_step.params if per_step is not None else None,
                    "engine_calls": engine_calls_per_rank, "settings": extra, "precision": ran, "initial": initial,
                    "batch": {"per_device_train_batch_size": per_device, "gradient_accumulation_steps": args.ga,
                              "num_processes": state.num_processes}},
                   out)
    if not last:
        state.wait_for_everyone()
        return
    if state.num_processes > 1:
        # Leave without destructors: freeing the gloo process group can deadlock at exit in torch 2.13 (its
        # destructor joins worker threads while holding the GIL; see recipes/grpo.py). Everything is saved.
        state.wait_for_everyone()
        trainer.end()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()

"""The TRL settings DTA refuses or adapts, checked against the trainer's config: tree rollouts in the config they run
in ([`check_tree_args`]), options DTA cannot honour exactly ([`check_trainer_args`]), and the engine's graph budget
under HF gradient checkpointing ([`graph_budget`]). The `dta_*` values on their own are `config.py`'s."""

from __future__ import annotations

import math

from .._checks import warn_once
from ..generation.tree_sampling import TREE_OFF
from ..refusal import TRAINER_ALTERNATIVE, TRAINER_CONFIG, Blocker, refuse
from .tree_advantages import PER_TOKEN


def check_tree_args(args) -> None:
    """Tree rollouts against the TRL config they run in (a validated `DTAGRPOConfig`); errors name the fix."""
    branching, length = args.dta_tree_branching, args.dta_tree_segment_length
    if branching is None:
        if length is not None or args.dta_tree_advantage != "group":
            raise ValueError(
                "`dta_tree_segment_length` and `dta_tree_advantage` shape tree rollouts, which are off: set "
                "`dta_tree_branching` (e.g. [4, 2]) too, or leave them at their defaults."
            )
        return
    if math.prod(branching) != args.num_generations:
        raise ValueError(
            f"`dta_tree_branching={branching}` makes {math.prod(branching)} completions per prompt, but "
            f"`num_generations={args.num_generations}`: the product of the branching factors must equal "
            f"`num_generations` (e.g. `num_generations={math.prod(branching)}`), {TREE_OFF}"
        )
    if len(branching) > 1:
        if length is None:
            raise ValueError(
                f"`dta_tree_branching={branching}` branches after each segment: set `dta_tree_segment_length` (tokens "
                f"per segment before each branch point), {TREE_OFF}"
            )
        if length * (len(branching) - 1) >= args.max_completion_length:
            raise ValueError(
                f"`dta_tree_segment_length={length}` puts the last branch point of `dta_tree_branching={branching}` at "
                f"completion token {length * (len(branching) - 1)}, not before `max_completion_length="
                f"{args.max_completion_length}`: use a segment length below "
                f"{math.ceil(args.max_completion_length / (len(branching) - 1))}, fewer levels, or a longer "
                f"`max_completion_length`, {TREE_OFF}"
            )
    refused = {
        "use_transformers_continuous_batching": "continuous batching schedules rows itself; use "
        "`use_transformers_continuous_batching=False`",
        "cache_implementation": "tree rollouts sample over their own generation cache; leave "
        "`cache_implementation=None`",
    }
    for name, why in refused.items():
        if getattr(args, name, None):
            raise ValueError(f"`dta_tree_branching` cannot be combined with `{name}={getattr(args, name)!r}`: {why}, "
                             f"{TREE_OFF}")
    if len(branching) > 1 and branching[0] == 1:
        raise ValueError(
            f"`dta_tree_branching={branching}` samples one first segment for all {args.num_generations} completions: "
            "it is in every completion's baseline, so its expected gradient is zero under every `dta_tree_advantage`. "
            f"Branch the first level at least twice (e.g. `{[2, *branching[1:]]}` with `num_generations` to match), "
            f"{TREE_OFF}"
        )
    mode = args.dta_tree_advantage
    if mode == "tree" and 1 in branching:
        raise ValueError(
            f"`dta_tree_advantage='tree'` compares a node with its siblings, so a level of one child "
            f"(`dta_tree_branching={branching}`) gets exactly zero advantage and is never trained. Use at least 2 "
            "children per level, or `dta_tree_advantage='unbiased'`, which has a baseline for every level."
        )
    if mode != "group" and args.dta_sample_layout == "per_turn":
        raise ValueError(
            f"`dta_tree_advantage={mode!r}` credits the segments of single-turn trees; "
            "`dta_sample_layout='per_turn'` is for multi-turn episodes. Keep `dta_sample_layout='episode'`, or "
            "`dta_tree_advantage='group'`."
        )
    if mode in PER_TOKEN:
        per_sequence = "use `dta_tree_advantage='group'` or 'treepo' (one advantage per completion)"
        if args.importance_sampling_level != "token":
            raise ValueError(
                f"`dta_tree_advantage={mode!r}` gives each token its segment's advantage, but "
                f"`importance_sampling_level={args.importance_sampling_level!r}` (GSPO, LUSPO) weighs a completion by "
                "one ratio, so its gradient mixes the segments' advantages into their mean over the completion. Set "
                f"`importance_sampling_level='token'`, or {per_sequence}."
            )
        if args.loss_type == "vespo" or args.off_policy_mask_threshold is not None:
            what = ("`loss_type='vespo'` picks its weights by the advantage's sign" if args.loss_type == "vespo"
                    else "`off_policy_mask_threshold` masks by the advantage's sign")
            raise ValueError(
                f"`dta_tree_advantage={mode!r}` gives each token its segment's advantage, but {what}, which TRL "
                f"decides per completion; with per-token advantages it would decide per token. Choose another "
                f"`loss_type` / `off_policy_mask_threshold=None`, or {per_sequence}."
            )


def graph_budget(dta, args) -> int | None:
    """The engine's `max_graph_tokens` from the validated `dta_*` settings `dta` ([`~config.DTAArguments`]) and the
    trainer's config `args`: `dta_max_graph_tokens`, or with HF gradient checkpointing on and no budget
    given, `dta_block_size` (with a one-time warning: DTA runs without HF checkpointing, which cannot reuse a prefix's
    keys/values, and bounds memory with its block recompute instead)."""
    if dta.dta_max_graph_tokens is not None or not args.gradient_checkpointing:
        return dta.dta_max_graph_tokens
    warn_once(
        "gradient_checkpointing",
        "gradient_checkpointing=True: HF gradient checkpointing cannot reuse a prefix's keys/values, so DTA runs "
        f"without it and bounds memory with DTA's block recompute instead (dta_max_graph_tokens={dta.dta_block_size})."
        " Micro-batches on TRL's dense path keep HF checkpointing. Set `dta_max_graph_tokens` to choose the budget, or "
        "`gradient_checkpointing=False` to keep every graph (fastest).",
    )
    return dta.dta_block_size


def check_trainer_args(args) -> None:
    """Options of the HF/TRL config that DTA cannot honour exactly: one refusal naming each with its fix."""
    blockers = []
    if args.fp16:
        blockers.append(Blocker(
            "`fp16=True` is not supported with DTA: fp16 training multiplies the loss by accelerate's dynamic "
            "GradScaler scale inside `accelerator.backward` and unscales the gradients before the optimizer step, but "
            "the DTA engine back-propagates inside `compute_loss`, so its gradients would miss that scale "
            "(`bf16=True`, TRL's default, is bf16 autocast; `bf16=False` is float32)",
            settings={"fp16": False}, where=TRAINER_CONFIG))
    if args.use_liger_kernel:
        blockers.append(Blocker(
            "`use_liger_kernel=True` is not supported with DTA: Liger replaces the model's layers with kernels whose "
            "equivalence with DTA is untested", settings={"use_liger_kernel": False}, where=TRAINER_CONFIG))
    if getattr(args.optim, "value", args.optim) in ("lomo", "adalomo"):
        blockers.append(Blocker(
            f"`optim={getattr(args.optim, 'value', args.optim)!r}` fuses the optimizer step into `backward`, which DTA "
            "calls many times per optimizer step", settings={"optim": "adamw_torch"}, where=TRAINER_CONFIG))
    refuse(f"A trainer with this {type(args).__name__}", blockers, alternative=TRAINER_ALTERNATIVE)

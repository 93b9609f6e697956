"""Configuration of the DTA trainers: the `dta_*` options and the two configs (the TRL settings DTA refuses or
adapts: `arg_checks.py`).

[`DTAArguments`] holds the `dta_*` fields, grouped by concern; each field's `help` text (what `--help` shows, at most
`config_doc.HELP_MAX` characters) and its [`DETAILS`] entry (the rest) are the one source of its documentation (the
configs' docstrings and the docs' page are rendered from them by `config_doc.py`). [`DTAGRPOConfig`]
and [`DTARLOOConfig`] are TRL's configs plus these fields, validated in `__post_init__` with `trl_dta._checks` (one rule
per kind of value: `True` is never a count, `2.0` is never a token budget, `nan` is never a threshold). """

from __future__ import annotations

from dataclasses import dataclass, field, fields

import trl
from trl import GRPOConfig, RLOOConfig

from .._checks import check_bool, check_choice, check_float, check_int, warn_once
from ..batch import SAMPLE_LAYOUTS
from ..kernels import BACKENDS
from ..parallel.fsdp2 import SCHEDULES
from .arg_checks import check_tree_args
from .config_doc import config_docstring, parameters_doc, parameters_markdown
from .tree_advantages import ADVANTAGES

# The TRL minor versions the equivalence tests (`tests/trainers/`) run against. The trainers override TRL private
# hooks (`_prepare_inputs`, `_get_per_token_logps_and_entropies`, `_compute_loss`) and read private attributes
# (`_step`, `_buffered_inputs`, `_metrics`), so another TRL version may change what "identical to TRL" means.
TESTED_TRL_VERSIONS = ("1.16",)


def check_trl_version(version: str | None = None) -> None:
    """Warn once when the installed TRL (or `version`) is not one of [`TESTED_TRL_VERSIONS`]."""
    version = trl.__version__ if version is None else version
    minor = ".".join(version.split(".")[:2])
    if minor not in TESTED_TRL_VERSIONS:
        warn_once(
            "trl_version",
            f"trl_dta's trainers are tested with TRL {', '.join(TESTED_TRL_VERSIONS)}; TRL {version} is installed. "
            "They override TRL's private hooks, so their results may differ from TRL's trainers on this version: "
            f"install `trl>={TESTED_TRL_VERSIONS[0]},<{_next_minor(TESTED_TRL_VERSIONS[-1])}`, or check the "
            "equivalence tests (`pytest tests/trainers`) on this version first.",
        )


def _next_minor(version: str) -> str:
    major, minor = version.split(".")
    return f"{major}.{int(minor) + 1}"


@dataclass
class DTAArguments:
    """The `dta_*` fields shared by [`DTAGRPOConfig`] and [`DTARLOOConfig`] (see their docstrings)."""

    # Whether and when DTA runs
    dta_enabled: bool = field(
        default=True,
        metadata={
            "help": "Whether to run the policy loss and the no-grad old-policy/reference log-probs through prefix "
            "trees (Dynamic Tree Attention). With `False` the trainer is exactly the TRL trainer."
        },
    )
    dta_min_compression: float = field(
        default=1.1,
        metadata={
            "help": "An optimizer step's forest (or a no-grad batch's tree) that compresses its tokens less than this "
            "ratio (tokens / tree tokens) runs TRL's dense path unchanged. `1.0` or less sends every batch through DTA."
        },
    )

    # Engine budgets
    dta_block_size: int = field(
        default=1024,
        metadata={
            "help": "Tokens per re-forward block when a tree segment's autograd graph is dropped and recomputed in "
            "the backward (DTA's token-wise checkpointing, used when `dta_max_graph_tokens` is exceeded)."
        },
    )
    dta_max_batch_tokens: int = field(
        default=8192,
        metadata={
            "help": "Padded-token budget of one forward of sibling leaves: the completions of one prompt are "
            "forwarded together, with the prompt's keys/values shared, up to this many tokens per forward."
        },
    )
    dta_max_pack_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Largest branching subtree, in tokens, that runs as one tree-masked row of a batched forward "
            "instead of walked. `None` lets the engine's cost model decide; `0` packs none."
        },
    )
    dta_max_graph_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Memory budget, in tokens of kept autograd graph; segments beyond it are recomputed in blocks of "
            "`dta_block_size` tokens. `None`: no budget, except `dta_block_size` with `gradient_checkpointing=True` "
            "(TRL's default)."
        },
    )

    # Attention kernels
    dta_attn_backend: str = field(
        default="auto",
        metadata={
            "help": "The engine's attention kernels: 'auto' (the fastest exact backend on the model's device), "
            "'torch', 'flash', 'triton' or 'sdpa' (the reference). All are exact."
        },
    )

    # Regrouping rows
    dta_group_shuffle: bool = field(
        default=False,
        metadata={
            "help": "Opt-in, changes which rows each micro-batch trains on: after TRL's random draw, a generation "
            "batch's rows go to micro-batches of TRL's size that keep each prompt's completions together, balanced by "
            "tree cost."
        },
    )
    dta_balance: bool = field(
        default=True,
        metadata={
            "help": "With several processes: after each generation, exchange whole prompt groups between ranks so that "
            "every rank trains on a forest of equal tree cost, where this leaves every update equal to TRL's."
        },
    )
    dta_cost_model: str = field(
        default="default",
        metadata={
            "help": "Cost of a forest for `dta_balance` and `dta_group_shuffle`: 'default' (from the model width) or "
            "'fit' (fitted to the engine's measured step times)."
        },
    )

    # Distributed engines
    dta_fsdp_schedule: str = field(
        default="window",
        metadata={
            "help": "Under FSDP2 (ignored otherwise): 'window' gathers the whole model once per optimizer step; "
            "'layer', for models too large to hold gathered, gathers each decoder layer inside every forward and "
            "backward."
        },
    )
    dta_zero3_gather_budget_mb: float | None = field(
        default=None,
        metadata={
            "help": "Under DeepSpeed ZeRO-3 (ignored otherwise): MiB per process for gathered parameters and their "
            "gradients; the whole model is gathered when it fits, else one decoder layer at a time. None: no budget; "
            "0: layer by layer."
        },
    )

    # Training rows of multi-turn episodes
    dta_sample_layout: str = field(
        default="episode",
        metadata={
            "help": "How multi-turn episodes (batches with a `tool_mask`) become training rows: 'episode' (TRL's: one "
            "row per episode, user and tool tokens masked out of the loss) or 'per_turn' (one row per assistant turn)."
        },
    )

    # Tree rollouts (generation)
    dta_tree_branching: list[int] | None = field(
        default=None,
        metadata={
            "help": "Opt-in tree rollouts (`DTAGRPOTrainer`): children per level of each prompt's sampling tree, e.g. "
            "`[4, 2]` (`--dta_tree_branching 4 2`): 4 first segments, each continued twice. `None` samples "
            "independently, as TRL does."
        },
    )
    dta_tree_segment_length: int | None = field(
        default=None,
        metadata={
            "help": "Completion tokens per segment before each branch point of `dta_tree_branching`; needed when it "
            "has more than one level."
        },
    )
    dta_tree_advantage: str = field(
        default="group",
        metadata={
            "help": "Advantages of tree rollouts: 'group' (TRL's), 'unbiased', 'tree', 'treepo' or 'treerl'; each "
            "mode's expected gradient per level is in `trl_dta.trainers.tree_advantages`."
        },
    )

    def validate_dta(self) -> None:
        """Check every `dta_*` value; errors name the field and the fix."""
        for name in ("dta_enabled", "dta_group_shuffle", "dta_balance"):
            check_bool(name, getattr(self, name))
        check_choice("dta_sample_layout", self.dta_sample_layout, SAMPLE_LAYOUTS)
        check_choice("dta_fsdp_schedule", self.dta_fsdp_schedule, SCHEDULES)
        if self.dta_sample_layout == "per_turn" and self.dta_group_shuffle:
            raise ValueError(
                "`dta_group_shuffle=True` regroups episodes, not turns: it cannot be combined with "
                "`dta_sample_layout='per_turn'`. Set `dta_group_shuffle=False` (DTA still shares prefixes across an "
                "optimizer step's micro-batches)."
            )
        self.dta_block_size = check_int("dta_block_size", self.dta_block_size, minimum=1)
        self.dta_max_batch_tokens = check_int("dta_max_batch_tokens", self.dta_max_batch_tokens, minimum=1)
        self.dta_max_pack_tokens = check_int("dta_max_pack_tokens", self.dta_max_pack_tokens, minimum=0,
                                             allow_none=True, hint="None lets the cost model decide, 0 packs none")
        self.dta_max_graph_tokens = check_int("dta_max_graph_tokens", self.dta_max_graph_tokens, minimum=0,
                                              allow_none=True, hint="None keeps every graph")
        self.dta_min_compression = check_float("dta_min_compression", self.dta_min_compression, minimum=0.0,
                                               hint="1.0 sends every batch through DTA")
        if self.dta_zero3_gather_budget_mb is not None:
            self.dta_zero3_gather_budget_mb = check_float(
                "dta_zero3_gather_budget_mb", self.dta_zero3_gather_budget_mb, minimum=0.0,
                hint="MiB per process; None for no budget, 0 to gather layer by layer")
        check_choice("dta_cost_model", self.dta_cost_model, ("default", "fit"))
        check_choice("dta_attn_backend", self.dta_attn_backend, BACKENDS)
        self._validate_tree_types()

    def _validate_tree_types(self) -> None:
        """The tree-rollout fields on their own (their relation to TRL's fields: [`check_tree_args`])."""
        branching = self.dta_tree_branching
        if branching is not None:
            if isinstance(branching, (str, bytes)) or not hasattr(branching, "__iter__"):
                raise TypeError(
                    f"`dta_tree_branching` must be a list of positive integers (children per level, e.g. [4, 2]) or "
                    f"None, got {branching!r}."
                )
            branching = [check_int("dta_tree_branching[]", b, minimum=1, hint="children per level") for b in branching]
            if not branching:
                raise ValueError("`dta_tree_branching` must list at least one level (e.g. [4, 2]), or be None.")
            self.dta_tree_branching = branching
        self.dta_tree_segment_length = check_int("dta_tree_segment_length", self.dta_tree_segment_length, minimum=1,
                                                 allow_none=True, hint="completion tokens per segment")
        check_choice("dta_tree_advantage", self.dta_tree_advantage, ADVANTAGES)

    @classmethod
    def from_config(cls, args) -> DTAArguments:
        """The `dta_*` settings of a config, validated; DTA's defaults for a plain TRL config."""
        settings = cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})
        settings.validate_dta()
        return settings


# Sections of the generated docstring, in the order of the fields.

# What `--help` leaves out: the rest of a field's documentation, after its `help` text in the configs' docstrings and
# the docs' page (`config_doc.py`). Not in the field's metadata: `HfArgumentParser` passes every metadata key to
# `argparse`.
DETAILS = {
    "dta_max_pack_tokens": (
        "A branching subtree of the prefix tree (e.g. a group of short multi-turn branches) packed into one row makes "
        "fewer, larger forward/backward calls, at the price of attention over the whole row. `None` lets the engine's "
        "cost model decide from the model's shape and device (on a GPU it packs, on a CPU it mostly walks); an int "
        "packs every branching subtree of at most that many tokens; `0` packs none (and no row holds two subtrees side "
        "by side). Chains (leaves, an episode's per-turn rows) always run as one causal row each."),
    "dta_max_graph_tokens": (
        "No budget keeps every graph (fastest). HF gradient checkpointing cannot reuse a prefix's keys/values, so with "
        "`gradient_checkpointing=True` DTA runs without it and bounds memory this way."),
    "dta_attn_backend": (
        "'auto' is 'torch' on CPU; 'flash' on CUDA when flash-attn is installed, else 'torch'. 'torch', 'flash' and "
        "'triton' store the prompt's keys/values once and attend them by all its completions in one call; 'sdpa' "
        "copies the prompt's keys/values once per completion of a batched forward. See `trl_dta.modeling.attention` "
        "for what each supports."),
    "dta_group_shuffle": (
        "The updates then stay TRL's only when every optimizer step covers whole generation batches "
        "(`gradient_accumulation_steps` a multiple of `steps_per_generation`), and, unless `steps_per_generation=1`, "
        "the loss does not depend on how rows form micro-batches (not `loss_type='bnpo'`, no entropy bonus, "
        "`top_entropy_quantile=1`); otherwise each optimizer step trains on other rows than TRL's, or with other "
        "normalisers, and a warning says so once. Logged per-micro-batch metrics differ in any case. With the default "
        "`False`, TRL's shuffle and split are kept exactly, and DTA still shares prefixes across all micro-batches of "
        "an optimizer step (one forest per step)."),
    "dta_balance": (
        "Each rank keeps its number of rows. Applied only where each optimizer step covers whole generation batches "
        "(`gradient_accumulation_steps` a multiple of `steps_per_generation`), the loss does not depend on which rows "
        "a rank holds (not `loss_type='bnpo'`, no entropy bonus, `top_entropy_quantile=1`), and each process's "
        "generation batch holds whole groups (a multiple of `num_generations` rows). Elsewhere ranks keep TRL's rows, "
        "and a warning says why once. With `dta_sample_layout='per_turn'`, ranks hold any number of turn rows and the "
        "rule is that layout's (see `dta_sample_layout`)."),
    "dta_cost_model": (
        "'default' is tree tokens + attention work + a per-leaf overhead, from the model width; 'fit' fits its "
        "coefficients by least squares to the engine's measured step times, gathered from all ranks, once 8 samples "
        "exist."),
    "dta_fsdp_schedule": (
        "FSDP2 is accelerate's `fsdp_version: 2`. 'window' reduce-scatters each group once (fewest collectives; memory "
        "of the unsharded parameters and gradients during the step); 'layer' is FSDP2's own schedule, the ranks' "
        "engine calls in lockstep over packed rows. See `trl_dta.parallel.fsdp2` for the collective counts and "
        "memory."),
    "dta_zero3_gather_budget_mb": (
        "The model fits when its parameters and trainable gradients do (`P b_p + P_t b_g`): each engine call then "
        "gathers the whole model once and the step's gradients are reduced in one pass; otherwise decoder layers are "
        "gathered one at a time by DeepSpeed's hooks (the ranks' engine calls in lockstep over packed rows) and their "
        "gradients reduce-scattered during each backward. See `trl_dta.parallel.zero3`."),
    "dta_sample_layout": (
        "Multi-turn batches come from a `rollout_func` that returns an `env_mask`, such as "
        "`trl_dta.envs.AgentRolloutFunc`, or from TRL's tool loop. With 'per_turn' a row's prompt is the conversation "
        "the policy saw and its advantage the episode's; an episode's turns are nested prefixes, which DTA computes "
        "once. Applies with `dta_enabled=False` too: TRL's dense path then trains on the same per-turn micro-batches. "
        "'per_turn' keeps every turn (micro-batches of near-equal size instead of TRL's equal split), and turns "
        "instead of episodes are what `grpo`, `sapo`, `luspo`, `bnpo` and `dr_grpo` average over (`dapo` and `cispo` "
        "weigh every policy token as 'episode' does); see `trl_dta.trainers.per_turn`. Any number of processes: ranks "
        "hold different numbers of turn rows, and each micro-batch is padded to the largest rank's count with rows "
        "that carry no loss (and, for the row-mean loss types, a factor on each micro-batch's loss undoes the "
        "padding's extra rows); with `gradient_accumulation_steps` a multiple of `steps_per_generation` the objective "
        "is the per-turn objective of one process for `dapo`, `cispo`, `vespo`, and for `grpo`, `sapo`, `luspo`, "
        "`dr_grpo` when the micro-batches are of equal size; elsewhere (`bnpo`, the entropy bonus) a warning says why "
        "not once (`trl_dta.trainers.micro_batches.per_turn_changes`). With 'per_turn', `dta_group_shuffle` is "
        "unavailable, and `dta_balance` exchanges whole prompt groups (all turns of a task's episodes) between ranks, "
        "by the cost of the per-turn forests, where the objective does not depend on the rows' ranks."),
    "dta_tree_branching": (
        "The product must equal `num_generations`, and a multi-level tree needs at least 2 first segments. Sampled "
        "with transformers' generation or TRL's colocated vLLM engine. Shared segments are generated once (their "
        "keys/values held once, continued by the children) and trained once by DTA. Each completion has the same "
        "distribution as TRL's completions, but the completions of a prompt are correlated, which changes what TRL's "
        "group advantage teaches each level (see `dta_tree_advantage`). Applies with `dta_enabled=False` too."),
    "dta_tree_segment_length": (
        "Branch points come after `S, 2S, ...` tokens; the last level continues to `max_completion_length`, so `S * "
        "(len(dta_tree_branching) - 1)` must be less than it."),
    "dta_tree_advantage": (
        "'group': TRL's own advantage of each completion over its group (the objective is TRL's, but a segment shared "
        "by `m` of the `G` completions gets `(G - m) / G` of its expected gradient instead of `(G - 1) / G`). "
        "'unbiased': per segment, the completion's advantage minus the mean of the completions outside the segment's "
        "subtree, times `(G - 1) / G`: every level gets TRL's `(G - 1) / G` of the policy gradient, as independent "
        "samples do. 'tree': per segment, its node's value minus its parent's (node value = mean advantage below it; "
        "closest to SPO-tree), `(b - 1) / b` on a level of `b` children. 'treepo': TreePO's per-completion "
        "size-weighted mean over its ancestor subgroups. 'treerl': TreeRL's per segment (global + local advantage of "
        "leave-one-out values) / sqrt(completions below). 'unbiased', 'tree' and 'treerl' are per token: they need "
        "`importance_sampling_level='token'`, no `off_policy_mask_threshold` and a loss type other than 'vespo'."),
}


_SECTIONS = (
    ("Parameters that control whether and when Dynamic Tree Attention runs", ("dta_enabled", "dta_min_compression")),
    ("Parameters that bound the engine's memory and batch sizes",
     ("dta_block_size", "dta_max_batch_tokens", "dta_max_pack_tokens", "dta_max_graph_tokens")),
    ("Parameters that choose the engine's attention kernels", ("dta_attn_backend",)),
    ("Parameters that regroup rows (micro-batches, ranks)", ("dta_group_shuffle", "dta_balance", "dta_cost_model")),
    ("Parameters of distributed engines", ("dta_fsdp_schedule", "dta_zero3_gather_budget_mb")),
    ("Parameters that shape the training rows of multi-turn episodes", ("dta_sample_layout",)),
    ("Parameters that sample completions as trees (tree rollouts)",
     ("dta_tree_branching", "dta_tree_segment_length", "dta_tree_advantage")),
)
def dta_parameters_doc() -> str:
    """The `dta_*` parameters in the Hugging Face docstring format, from the fields' help text (one source)."""
    return parameters_doc(DTAArguments, _SECTIONS, DETAILS)


def dta_parameters_markdown() -> str:
    """The `dta_*` parameters as Markdown (the docs site's configuration page), from the same help text as
    [`dta_parameters_doc`] (`config_doc.parameters_markdown`). `docs/hooks.py` puts it into `docs/config.md`."""
    return parameters_markdown(DTAArguments, _SECTIONS, DETAILS)


@dataclass
class DTAGRPOConfig(DTAArguments, GRPOConfig):
    def __post_init__(self):
        super().__post_init__()
        self.validate_dta()
        check_tree_args(self)


@dataclass
class DTARLOOConfig(DTAArguments, RLOOConfig):
    def __post_init__(self):
        super().__post_init__()
        self.validate_dta()
        if self.dta_tree_branching is not None:
            raise ValueError(
                "Tree rollouts (`dta_tree_branching`) are implemented for `DTAGRPOTrainer` (TRL's GRPO generation "
                "hook); `RLOOTrainer` generates through another hook. Set `dta_tree_branching=None`, or train with "
                "`DTAGRPOTrainer`."
            )
        if self.dta_sample_layout != "episode":
            raise ValueError(
                "TRL's RLOOTrainer has no multi-turn rollouts (no `rollout_func` or tools), so its batches have no "
                "turns: keep `dta_sample_layout='episode'`, or train multi-turn episodes with `DTAGRPOTrainer`."
            )


DTAGRPOConfig.__doc__ = config_docstring("DTAGRPOTrainer", "GRPOConfig", dta_parameters_doc())
DTARLOOConfig.__doc__ = config_docstring("DTARLOOTrainer", "RLOOConfig", dta_parameters_doc())

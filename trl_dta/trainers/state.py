"""What the trainer's hooks share between their calls: one [`HookState`] the trainer holds (`_dta_state`).

TRL calls the hooks the mixin overrides (`_prepare_inputs`, `training_step`, `compute_loss`, the generation hooks)
one at a time; what one hook leaves for a later one lives here, each field naming its writer and its reader, rather
than in attributes spread over the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .tree_rollouts import TreeGeneration
    from .window import MicroStep


@dataclass
class HookState:
    """What the trainer's hooks share between their calls, in one object the trainer holds (`_dta_state`): each field
    says which hook writes it and which reads it.

    Args:
        window_position (`int`): micro-steps done in the current accumulation window (`training_step` counts them;
            `compute_loss` reads them for the window's remaining length).
        micro_steps (`dict[int, MicroStep]`): the window forest's micro-steps still to train, keyed by TRL's micro-step
            (`compute_loss` stores a window's and pops each; `training_step` clears them at the window's end).
        step_time (`float`): seconds of engine forward/backward in this optimizer step (`compute_loss` adds,
            `training_step` logs and resets).
        cost_samples (`list[tuple[float, float, float, float]]`): each forest's tree tokens, attention work, leaves and
            seconds, for `dta_cost_model="fit"` (`compute_loss` appends, `_prepare_inputs` refits the cost model).
        replay (`tuple`, *optional*): `(logps, entropies, aux_loss)`, `(B, T)`, `(B, T)` or None, 0-d or None: what
            `_get_per_token_logps_and_entropies` returns instead of running the model, set around a call of TRL's
            `_compute_loss` (`compute_loss`, the two-pass path).
        generation (`TreeGeneration`, *optional*): tree rollouts (`tree_rollouts.py`): the generation being scored,
            open around TRL's `_generate_and_score_completions`, filled by `_generate_single_turn` and
            `_calculate_rewards`.
        phase_seconds (`tuple[float, float]`): `(generation, generation and scoring)` seconds since the last optimizer
            step (`phases.StepPhases`: `_generate` and `_generate_and_score_completions` add, `training_step` logs and
            resets).
    """

    window_position: int = 0
    micro_steps: dict[int, MicroStep] = field(default_factory=dict)
    step_time: float = 0.0
    cost_samples: list[tuple[float, float, float, float]] = field(default_factory=list)
    replay: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
    generation: TreeGeneration | None = None
    phase_seconds: tuple[float, float] = (0.0, 0.0)


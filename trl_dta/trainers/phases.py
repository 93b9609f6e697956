"""Where an optimizer step's time goes: generation, scoring, training.

TRL logs `step_time`, the seconds of an optimizer step's `training_step` calls, which include generating and scoring
the rollouts (TRL's `_prepare_inputs` runs inside `training_step`). [`StepPhases`] times the two parts TRL runs before
training, with the trainer's own methods, and logs them per optimizer step beside TRL's `step_time`:

```
step_time (TRL) = generation + scoring + training
  generation: `_generate`, the rollouts' sampling (transformers' generate, a `rollout_func`, TRL's tool loop)
  scoring:    the rest of `_generate_and_score_completions` (rewards, old-policy and reference log-probs, advantages)
  training:   the remainder (the policy's forward/backward: DTA's engine, or TRL's dense path; the optimizer step)
```

A generation batch serves `steps_per_generation` optimizer steps (and `num_iterations` passes): its seconds count in
the optimizer step that generated it. Evaluation's generation is not counted. Metrics: `generation_time`,
`scoring_time` (seconds per optimizer step, named as TRL's `step_time`; logged with `dta_enabled=False` too, so that
a dense run compares, and therefore without the `dta/` prefix a disabled trainer never logs).
"""

from __future__ import annotations

import contextlib
import time

from . import _trl


class StepPhases:
    """Times TRL's `_generate` and `_generate_and_score_completions` (see the module docstring); put it between the
    DTA mixin and the TRL trainer in the bases. The seconds since the last optimizer step live in the hook state
    (`state.HookState.phase_seconds`)."""

    def _generate(self, prompts):
        with self._dta_timed(0):
            return super()._generate(prompts)

    def _generate_and_score_completions(self, inputs):
        with self._dta_timed(1):
            return super()._generate_and_score_completions(inputs)

    @contextlib.contextmanager
    def _dta_timed(self, phase: int):
        """Adds the seconds of the block to `phase_seconds[phase]` (0: generation, 1: generation and scoring) when
        training (evaluation's generation is not counted)."""
        if not self.model.training:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = list(self._dta_state.phase_seconds)
            seconds[phase] += time.perf_counter() - start
            self._dta_state.phase_seconds = tuple(seconds)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if _trl.step(self) % self.current_gradient_accumulation_steps == 0:  # TRL logs `step_time` at the same point
            generation, total = self._dta_state.phase_seconds
            metrics = _trl.metrics(self, "train")
            metrics["generation_time"].append(generation)
            metrics["scoring_time"].append(total - generation)
            self._dta_state.phase_seconds = (0.0, 0.0)
        return loss

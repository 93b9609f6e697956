"""The `Generator` protocol (`trl_dta/generation/generator.py`) is real: a second `Generator`, written here (plain
`model.generate` on whole prompts, no cache), plugs into the trainer's tree rollouts (`TreeRollouts`) and the agent
rollout function (`AgentRolloutFunc`) through the one place that chooses the implementation
(`trl_dta.trainers.generator.policy_generator`), without changing either: they sample through it and return its
log-probs."""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from types import SimpleNamespace

import torch
from transformers import GenerationConfig

from tests.trainers.conftest import EOS, PAD, build_model
from trl_dta.demos.tiny import build_model as build_tiny_model
from trl_dta.demos.tiny import build_tokenizer
from trl_dta.envs import AgentRolloutFunc
from trl_dta.generation import CacheStats, Generation, TreeSampler
from trl_dta.trainers import tree_rollouts
from trl_dta.trainers.state import HookState


class PlainGenerate:
    """A `Generator` over plain `model.generate` (left-padded whole prompts, `num_return_sequences=n`), recording the
    calls it saw."""

    def __init__(self, model, eos: int, pad: int, generation_config: GenerationConfig):
        self.model, self.eos, self.pad, self.generation_config = model, eos, pad, generation_config
        self.stats, self.calls = CacheStats(), []

    def __call__(self, prompts, max_new_tokens, *, n=1, settings=None):
        self.calls.append((len(prompts), n))
        config = copy.deepcopy(self.generation_config if settings is None else settings)
        config.update(max_new_tokens=max(max_new_tokens), num_return_sequences=n, eos_token_id=self.eos,
                      pad_token_id=self.pad, output_scores=True, return_dict_in_generate=True)
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        self.stats.forward_calls += 1
        new = out.sequences[:, width:]
        logprobs = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, new[..., None])[..., 0]
        samples = []
        for row, budget in enumerate(b for b in max_new_tokens for _ in range(n)):
            kept = new[row, :budget].tolist()
            end = kept.index(self.eos) + 1 if self.eos in kept else len(kept)
            samples.append(Generation(kept[:end], logprobs[row, :end].tolist()))
        return samples


def _plug(monkeypatch, generator):
    """`generator` as the trainer's policy, where tree rollouts and the rollout functions take it from."""

    @contextlib.contextmanager
    def policy_generator(trainer, tokenizer=None, *, cache=True):
        yield generator

    monkeypatch.setattr("trl_dta.trainers.generator.policy_generator", policy_generator)
    monkeypatch.setattr(tree_rollouts, "policy_generator", policy_generator)


def test_a_second_generator_plugs_into_tree_rollouts(monkeypatch):
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, eos_token_id=[EOS], pad_token_id=PAD)
    generator = PlainGenerate(build_model(10, seed=3).eval(), EOS, PAD, config)
    _plug(monkeypatch, generator)
    rollouts = tree_rollouts.TreeRollouts(TreeSampler((2, 2), 2, 5, config, (EOS,), PAD), "group")
    metrics = defaultdict(list)
    trainer = SimpleNamespace(model=SimpleNamespace(training=True), _metrics={"train": metrics},
                              _dta_state=HookState())
    prompts = [[5, 6, 7, 3]] * 4 + [[9, 4]] * 4
    torch.manual_seed(0)
    completions, logprobs = rollouts.generate(trainer, prompts, 4)
    assert generator.calls[0] == (2, 2)  # the first level: two prompts, two children each
    assert all(n == 2 for _, n in generator.calls)
    assert len(completions) == len(logprobs) == 8
    for completion, lps in zip(completions, logprobs):
        assert 1 <= len(completion) <= 5 and len(lps) == len(completion)
        assert all(lp <= 0.0 for lp in lps)
    for group in (completions[:2], completions[2:4], completions[4:6], completions[6:]):  # one first-level node each
        assert group[0][:2] == group[1][:2]
    assert metrics["dta/generated_tokens"] and metrics["dta/generated_tokens"][0] <= sum(map(len, completions))


def test_a_second_generator_plugs_into_the_agent_rollout_function(monkeypatch, domain):
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0)
    generator = PlainGenerate(build_tiny_model(tokenizer).eval(), tokenizer.eos_token_id, tokenizer.pad_token_id,
                              config)
    _plug(monkeypatch, generator)
    metrics = {"train": defaultdict(list)}
    trainer = SimpleNamespace(use_vllm=False, model=SimpleNamespace(training=True), num_generations=4,
                              processing_class=tokenizer, max_completion_length=8, _metrics=metrics)
    rollout = AgentRolloutFunc(domain, max_turns=2, max_tokens=800, branching=[2, 2])
    out = rollout([domain.prompt(0)] * 4, trainer)
    assert generator.calls and all(n == 1 for _, n in generator.calls)
    assert len(out["completion_ids"]) == 4
    for completion_ids, lps, env_mask in zip(out["completion_ids"], out["logprobs"], out["env_mask"]):
        assert len(lps) == len(completion_ids) == len(env_mask)
        assert any(lp < 0.0 for lp, policy_token in zip(lps, env_mask) if policy_token)  # the generator's log-probs
    assert metrics["train"]["dta/generated_tokens"][0] > 0

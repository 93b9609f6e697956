"""Multi-turn agent episodes in `DTAGRPOTrainer`: both sample layouts, DTA against TRL's dense path on the same rows.

Episodes are the real retail environment's (`trl_dta.envs`), played by scripted agents and handed to the trainer as
TRL's `rollout_func` (`test_per_turn.ReplayRollout`): generation is not what is tested here, and replaying keeps the
tests fast. The trained model is real (the tiny Qwen2 of `demos.tiny`, float32), as are the trainers, the rewards
(`trl_dta.envs.episode_reward`), the advantages and the optimizer (SGD, so updates are proportional to gradients).

- `dta_sample_layout="per_turn"`: DTA equals `dta_enabled=False`, which trains TRL's dense path on the same per-turn
  micro-batches; `num_iterations` 1 and 2, `beta` 0 and > 0 (reference model reloaded from a folder, or the
  adapter-disabled LoRA model).
- `"episode"`: DTA equals TRL's `GRPOTrainer`.
- Across layouts: with `loss_type="dapo"` (every policy token weighs `1 / num_items_in_batch` in both layouts) and one
  optimizer step per generation, the per-turn layout trains exactly what the episode layout trains: the turn rows
  carry the episode rows' tokens, contexts, advantages and loss-token count.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from trl_dta.demos.tiny import build_default_model_dir, build_tokenizer
from trl_dta.envs import build_dataset, episode_reward
from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer, DTARLOOConfig

from .conftest import Run, assert_equivalent, assert_params_close, make_args
from .test_per_turn import MAX_TOKENS, ReplayRollout

G = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tiny model's matmuls gain nothing from more, and on a busy CPU they stall."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def agent_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def agent_model_dir(tmp_path_factory) -> str:
    """The tiny model in a folder (TRL reloads the reference model from it when `beta > 0`)."""
    return str(build_default_model_dir(tmp_path_factory.mktemp("agent_model"), hidden_size=32,
                                       max_position_embeddings=MAX_TOKENS))


def train_agent(trainer_cls, config_cls, model_dir, tokenizer, domain, output_dir, steps: int = 2,
                trainer_kwargs: dict | None = None, **config) -> Run:
    """Train `steps` optimizer steps on replayed episodes (2 tasks x `G` episodes per generation)."""
    rollout = ReplayRollout(domain, tokenizer, variants=G)
    config = {"per_device_train_batch_size": 4, "num_generations": G, "max_completion_length": 64, **config}
    trainer = trainer_cls(model=model_dir, reward_funcs=episode_reward, args=make_args(config_cls, output_dir, steps,
                                                                                        **config),
                          train_dataset=build_dataset(domain, 8), processing_class=tokenizer, rollout_func=rollout,
                          **(trainer_kwargs or {}))
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return Run(trainer, logs, [e.ids for call in rollout.calls for e in call], initial, final)


def compare_dta(tmp_path, model_dir, tokenizer, domain, layout: str, dtype=torch.float64, **config):
    """DTA against the dense path on the same layout: the same episodes, losses, metrics and parameters; in float64
    within the float32 steps of a float64 model (`conftest.float64_rtol`), in float32 as close to the dense path's
    float64 run as the dense path's own float32 run (`conftest.assert_as_precise_run`)."""

    def dense(name, dtype):
        kw = {**config, "model_init_kwargs": {"dtype": dtype}}
        if layout == "episode":
            return train_agent(GRPOTrainer, GRPOConfig, model_dir, tokenizer, domain, tmp_path / name, **kw)
        return train_agent(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, domain, tmp_path / name,
                           dta_enabled=False, dta_sample_layout=layout, **kw)

    ref = dense("dense", dtype)
    dta = train_agent(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, domain, tmp_path / "dta",
                      dta_sample_layout=layout, model_init_kwargs={"dtype": dtype}, **config)
    assert all(entry["dta/dense_fallback"] == 0.0 for entry in dta.logs if "dta/dense_fallback" in entry)
    assert any("dta/tree_tokens" in entry for entry in dta.logs), "no micro-batch ran through DTA"
    if dtype == torch.float64:
        assert_params_close(ref, dta)
        assert_equivalent(ref, dta)
    else:
        assert_equivalent(ref, dta, reference=dense("dense_fp64", torch.float64))
    return ref, dta


def micro_batch_rows(run: Run) -> list[int]:
    return [len(batch["prompt_ids"]) for batch in run.trainer._buffered_inputs]


@pytest.mark.parametrize("num_iterations,beta,loss_type,dtype", [(1, 0.0, "dapo", torch.float64),
                                                                   (2, 0.1, "grpo", torch.float32)])
def test_per_turn_dta_equals_dense(tmp_path, agent_model_dir, agent_tokenizer, domain, num_iterations, beta,
                                   loss_type, dtype):
    ref, dta = compare_dta(tmp_path, agent_model_dir, agent_tokenizer, domain, "per_turn", dtype,
                              num_iterations=num_iterations, beta=beta, loss_type=loss_type)
    episodes = ref.trainer.rollout_func.calls[-1]  # the generation `_buffered_inputs` holds
    turns = sum(len(e.turns) for e in episodes)
    assert len(episodes) == 2 * G and turns > len(episodes)
    # Every turn is a row of some micro-batch (none dropped by the split), in micro-batches of near-equal size.
    assert sum(micro_batch_rows(dta)) == sum(micro_batch_rows(ref)) == turns
    assert max(micro_batch_rows(dta)) - min(micro_batch_rows(dta)) <= 1
    # The step's forest spans both micro-batches: it shares more than each micro-batch's own tree.
    for entry in dta.logs:
        assert entry["dta/compression_ratio"] > entry["dta/compression_ratio_micro_batch"] > 2.0


def test_per_turn_lora(tmp_path, agent_model_dir, agent_tokenizer, domain):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM")
    compare_dta(tmp_path, agent_model_dir, agent_tokenizer, domain, "per_turn", beta=0.1, num_iterations=2,
                learning_rate=0.5, trainer_kwargs={"peft_config": lora})


def test_episode_dta_equals_trl(tmp_path, agent_model_dir, agent_tokenizer, domain):
    ref, dta = compare_dta(tmp_path, agent_model_dir, agent_tokenizer, domain, "episode", num_iterations=2)
    assert sum(micro_batch_rows(dta)) == 2 * G


def test_per_turn_trains_what_episode_trains_with_dapo(tmp_path, agent_model_dir, agent_tokenizer, domain):
    # dapo weighs every policy token 1 / num_items_in_batch in both layouts, and with gradient_accumulation_steps =
    # steps_per_generation every optimizer step sums over the whole generation: the same objective. Through DTA
    # (equal to the dense path in each layout, above), in float64: the turn rows carry the episode rows' tokens,
    # positions, advantages, old and reference log-probs.
    config = dict(loss_type="dapo", beta=0.1, num_iterations=2, model_init_kwargs={"dtype": torch.float64})
    episode = train_agent(DTAGRPOTrainer, DTAGRPOConfig, agent_model_dir, agent_tokenizer, domain,
                          tmp_path / "episode", dta_sample_layout="episode", **config)
    per_turn = train_agent(DTAGRPOTrainer, DTAGRPOConfig, agent_model_dir, agent_tokenizer, domain,
                           tmp_path / "per_turn", dta_sample_layout="per_turn", **config)
    assert sum(micro_batch_rows(per_turn)) > sum(micro_batch_rows(episode))
    assert_params_close(episode, per_turn)
    assert_equivalent(episode, per_turn, compare_metrics=False)


def test_per_turn_needs_tool_mask(tmp_path, agent_model_dir, agent_tokenizer):
    from datasets import Dataset

    args = make_args(DTAGRPOConfig, tmp_path, 1, per_device_train_batch_size=4, num_generations=4,
                     dta_sample_layout="per_turn")
    trainer = DTAGRPOTrainer(model=agent_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                             args=args, train_dataset=Dataset.from_dict({"prompt": ["abc", "def"]}),
                             processing_class=agent_tokenizer)
    with pytest.raises(ValueError, match="tool_mask.*env_mask"):
        trainer.train()


def test_config_checks_layout():
    with pytest.raises(ValueError, match="dta_sample_layout"):
        DTAGRPOConfig(output_dir="unused", dta_sample_layout="turns", use_cpu=True, bf16=False)
    assert DTAGRPOConfig(output_dir="unused", use_cpu=True, bf16=False).dta_sample_layout == "episode"
    assert "dta_sample_layout" in DTAGRPOConfig.__doc__
    with pytest.raises(ValueError, match="dta_group_shuffle"):
        DTAGRPOConfig(output_dir="unused", dta_sample_layout="per_turn", dta_group_shuffle=True, use_cpu=True,
                      bf16=False)
    with pytest.raises(ValueError, match="RLOOTrainer has no multi-turn rollouts"):
        DTARLOOConfig(output_dir="unused", dta_sample_layout="per_turn", use_cpu=True, bf16=False)

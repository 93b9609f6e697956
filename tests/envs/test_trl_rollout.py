"""The TRL bridge: the dataset, `AgentRolloutFunc` inside a real `GRPOTrainer`, the reward function, and the
`environment_factory` class (checked the way TRL inspects it; a run needs a hub model with a tool-calling template)."""

from __future__ import annotations

import inspect

import pytest
from transformers.utils import get_json_schema

from trl_dta.demos.tiny import build_model, build_tokenizer
from trl_dta.envs import AgentRolloutFunc, RetailToolEnv, build_dataset, episode_reward


def test_dataset(domain):
    rows = build_dataset(domain, 3, first_task=5)
    assert rows["task_id"] == [5, 6, 7] and rows["prompt"] == [domain.prompt(i) for i in (5, 6, 7)]
    chat = build_dataset(domain, 2, conversational=True)
    assert chat["prompt"][1] == [{"role": "system", "content": domain.system_prompt},
                                 {"role": "user", "content": domain.task(1).opening}]
    with pytest.raises(ValueError, match="num_tasks"):
        build_dataset(domain, 0)


def test_rollout_func_in_grpo_trainer(domain, tmp_path, monkeypatch):
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = build_tokenizer()
    rollout = AgentRolloutFunc(domain, max_turns=3, max_tokens=800)
    returned = []

    def recording_rollout(prompts, trainer):
        returned.append((prompts, rollout(prompts, trainer)))
        return returned[-1][1]

    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, max_steps=1,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8, logging_steps=1,
                      save_strategy="no", temperature=0.9)
    trainer = GRPOTrainer(model=build_model(tokenizer), reward_funcs=episode_reward, args=args,
                          train_dataset=build_dataset(domain, 2), processing_class=tokenizer,
                          rollout_func=recording_rollout)
    trainer.train()

    (prompts, out), = returned
    assert len(prompts) == 4 and len(set(prompts)) == 1  # one prompt, num_generations rows
    task_id = domain.task_id_of(prompts[0])
    for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "episode_reward", "turn_spans", "end_reason"):
        assert len(out[key]) == 4, key
    for prompt_ids, completion_ids, logprobs, env_mask, spans in zip(
            out["prompt_ids"], out["completion_ids"], out["logprobs"], out["env_mask"], out["turn_spans"]):
        assert prompt_ids == tokenizer(domain.prompt(task_id))["input_ids"]
        assert len(completion_ids) == len(logprobs) == len(env_mask)
        offset = len(prompt_ids)
        policy = [0] * len(completion_ids)
        for start, end in spans:
            assert 0 < end - start <= args.max_completion_length
            policy[start - offset:end - offset] = [1] * (end - start)
        assert env_mask == policy and spans[0][0] == offset and spans[-1][1] == offset + len(completion_ids)
    log = trainer.state.log_history[0]
    # TRL took env_mask as its tool_mask (lengths count policy tokens only) and scored with the episode rewards.
    assert log["completions/mean_length"] == pytest.approx(sum(map(sum, out["env_mask"])) / 4)
    assert log["reward"] == pytest.approx(sum(out["episode_reward"]) / 4)


def test_episode_reward():
    assert episode_reward(["a", "b"], episode_reward=[1, 0.25]) == [1.0, 0.25]
    with pytest.raises(ValueError, match="AgentRolloutFunc"):
        episode_reward(["a"], episode_reward=[])


def test_tool_env_as_trl_sees_it(domain):
    env = RetailToolEnv(domain)
    # TRL's rule: every public function of the class except reset and get_reward becomes a tool.
    names = [name for name, _ in inspect.getmembers(RetailToolEnv, predicate=inspect.isfunction)
             if name not in ("reset", "get_reward") and not name.startswith("_")]
    assert sorted(names) == ["cancel_order", "change_city", "find_user", "get_order", "get_user", "return_item"]
    for name in names:
        schema = get_json_schema(getattr(env, name))["function"]
        assert schema["name"] == name and set(schema["parameters"]["required"]) == \
            set(inspect.signature(getattr(env, name)).parameters)

    task = next(domain.task(i) for i in range(20) if domain.task(i).kind == "cancel")
    env.reset(task_id=task.task_id, prompt="ignored")
    for action in task.gold_actions:
        assert not getattr(env, action.tool.replace("-", "_"))(**action.kwargs).startswith("error:")
    assert env.get_reward() == 1.0
    env.reset(task_id=task.task_id)
    assert env.get_order(order=task.order_id) == "error: find the user with find-user first."
    assert env.get_reward() == 0.0
    with pytest.raises(RuntimeError, match="reset"):
        RetailToolEnv(domain).get_user(user="u1")


@pytest.mark.vllm
def test_rollout_func_through_vllm_plays_the_transformers_turns(domain, tmp_path, monkeypatch, vllm_engines):
    """`AgentRolloutFunc` in a `GRPOTrainer(use_vllm=True, vllm_mode="colocate")` (the session's float32 engine): each
    turn one `generate` call of the trainer's engine. Greedy (vLLM's `temperature=0`; transformers' `do_sample=False`)
    the episodes equal those of transformers' generation token for token; the log-probs are vLLM's; the shared system
    prompt's blocks come from vLLM's prefix cache (`dta/rollout_cached_tokens`), so fewer tokens are forwarded than the
    episodes hold."""
    import torch
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = AutoTokenizer.from_pretrained(vllm_engines.model_dir)
    rollout = AgentRolloutFunc(domain, max_turns=3, max_tokens=800)
    runs = {}
    for name, vllm in (("transformers", dict(generation_kwargs={"do_sample": False})),
                       ("vllm", dict(use_vllm=True, vllm_mode="colocate", generation_kwargs={"temperature": 0.0}))):
        returned = []

        def recording_rollout(prompts, trainer, returned=returned):
            returned.append(rollout(prompts, trainer))
            return returned[-1]

        args = GRPOConfig(output_dir=str(tmp_path / name), report_to="none", use_cpu=True, bf16=False, max_steps=1,
                          per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                          logging_steps=1, save_strategy="no", **vllm)
        with vllm_engines.shared(torch.float32):
            trainer = GRPOTrainer(model=vllm_engines.model_dir, reward_funcs=episode_reward, args=args,
                                  train_dataset=build_dataset(domain, 2), processing_class=tokenizer,
                                  rollout_func=recording_rollout)
            trainer.train()
        runs[name] = returned[0], trainer.state.log_history[0]
    (ref, ref_log), (out, log) = runs["transformers"], runs["vllm"]
    assert out["prompt_ids"] == ref["prompt_ids"] and out["completion_ids"] == ref["completion_ids"]
    assert out["env_mask"] == ref["env_mask"]
    for completion, logprobs, mask in zip(out["completion_ids"], out["logprobs"], out["env_mask"]):
        assert len(logprobs) == len(completion)
        assert all(lp <= 0.0 for lp, m in zip(logprobs, mask) if m)  # greedy: the processed distribution's argmax
    assert "dta/rollout_cached_tokens" not in ref_log and log["dta/rollout_cached_tokens"] > 0
    assert log["dta/rollout_forward_tokens"] + log["dta/rollout_cached_tokens"] >= log["dta/rollout_tokens"]
    assert log["dta/rollout_forward_tokens"] < log["dta/rollout_tokens"]

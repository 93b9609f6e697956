"""End to end on tau2's mock domain (its real tools, tasks, database and evaluator) with the tiny model: a GRPO step
through TRL's own tool loop (`environment_factory=tau2_tool_env(domain)`) and one through `rollout_func`
(`Tau2RolloutFunc`, the offline scripted user), each in the `episode` and `per_turn` layouts; DTA equal to the dense
path on the same rollouts, in float64 (SGD parameter updates and logged values within the float32 steps TRL keeps in a
float64 model, `tests/trainers/conftest.float64_rtol`).

The tool-loop runs generate with a scripted policy (`_generate_single_turn` replays gold actions and variants of them),
since a random tiny model never writes a valid tool call: TRL's loop still parses the calls, runs them on the
environments, renders the results and masks them. The rollout_func runs sample from the tiny model itself; its turns
are text, answered by the scripted user until it hangs up or the turn limit."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from tests.trainers.conftest import Run, assert_equivalent, make_args
from trl_dta.demos.tiny import build_model
from trl_dta.envs.tau2 import Tau2RolloutFunc, build_tau2_dataset, tau2_reward, tau2_tool_env, tau2_tool_reward
from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer

from .conftest import turn_ids

G = 4
TASKS = ["create_task_1", "update_task_1"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, chat_tokenizer) -> str:
    path = tmp_path_factory.mktemp("tau2_tiny")
    build_model(chat_tokenizer, hidden_size=32, max_position_embeddings=8192).save_pretrained(path)
    chat_tokenizer.save_pretrained(path)
    return str(path)


def spread(completion_ids, **kwargs) -> list[float]:
    """A second reward with spread (episode length), so that every group has non-zero advantages."""
    return [float(len(ids) % 5) for ids in completion_ids]


def _variants(domain, task_id: str) -> list[list]:
    """The scripted policy's G episodes of a task: gold, gold without its write, an unknown tool first, text only."""
    gold = domain.gold_turns(domain.task(task_id))
    unknown = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "delete_everything", "arguments": {}}}]}
    return [gold, gold[1:], [unknown] + gold, gold[-1:]]


class ScriptedTurns:
    """Replaces generation in TRL's tool loop: the k-th copy of a task's prompt plays the task's k-th variant."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        tokenizer = self.processing_class
        if not hasattr(self, "_open"):
            self._open, self._prompt_task = [], {}
            for row in self.train_dataset:
                ids = tokenizer.apply_chat_template(row["prompt"], tools=self.tools, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
                self._prompt_task[tuple(ids)] = row["task_id"]
        out, seen = [], Counter()
        for prefix in prompt_ids:
            prefix = tuple(prefix)
            match = max((o for o in self._open if prefix[:len(o[0])] == o[0]), key=lambda o: len(o[0]), default=None)
            if match is None:  # a fresh rollout: its task's next variant
                task = self._prompt_task[prefix]
                script, n = _variants(self._domain, task)[seen[task] % G], 0
                seen[task] += 1
            else:
                self._open.remove(match)
                _, script, n = match
            ids = turn_ids(tokenizer, script[min(n, len(script) - 1)])
            self._open.append((prefix + tuple(ids), script, n + 1))
            out.append(ids)
        return out, None


class ScriptedGRPOTrainer(ScriptedTurns, GRPOTrainer):
    pass


class ScriptedDTAGRPOTrainer(ScriptedTurns, DTAGRPOTrainer):
    pass


def _train(trainer_cls, config_cls, model_dir, tokenizer, domain, out, *, tool_loop: bool, **config) -> Run:
    completions = []

    def record(completion_ids, **kwargs):
        completions.extend(list(ids) for ids in completion_ids)
        return [0.0] * len(completion_ids)

    dataset = build_tau2_dataset(domain, TASKS)
    config = {"per_device_train_batch_size": 4, "num_generations": G, **config}
    if tool_loop:
        kwargs = dict(environment_factory=tau2_tool_env(domain), reward_funcs=[tau2_tool_reward, spread, record])
        config.update(max_completion_length=1024)
    else:
        kwargs = dict(rollout_func=Tau2RolloutFunc(domain, max_turns=3, max_tokens=8192),
                      reward_funcs=[tau2_reward, spread, record])
        config.update(max_completion_length=6, generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], 3.0]]})
    args = make_args(config_cls, out, 1, **config)
    trainer = trainer_cls(model=model_dir, args=args, train_dataset=dataset, processing_class=tokenizer, **kwargs)
    trainer._domain = domain
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return Run(trainer, logs, completions, initial, final)


@pytest.mark.slow
@pytest.mark.parametrize("tool_loop", [True, False], ids=["tool_loop", "rollout_func"])
@pytest.mark.parametrize("layout", ["episode", "per_turn"])
def test_dta_equals_dense_on_tau2(tmp_path, model_dir, chat_tokenizer, mock, tool_loop, layout):
    scripted = tool_loop
    base = (ScriptedGRPOTrainer, GRPOConfig) if scripted else (GRPOTrainer, GRPOConfig)
    dta_cls = ScriptedDTAGRPOTrainer if scripted else DTAGRPOTrainer
    common = {"model_init_kwargs": {"dtype": torch.float64}}  # exactness (`conftest.float64_rtol`)
    if layout == "episode":
        ref = _train(*base, model_dir, chat_tokenizer, mock, tmp_path / "ref", tool_loop=tool_loop, **common)
    else:
        ref = _train(dta_cls, DTAGRPOConfig, model_dir, chat_tokenizer, mock, tmp_path / "ref", tool_loop=tool_loop,
                     dta_enabled=False, dta_sample_layout=layout, **common)
    dta = _train(dta_cls, DTAGRPOConfig, model_dir, chat_tokenizer, mock, tmp_path / "dta", tool_loop=tool_loop,
                 dta_sample_layout=layout, **common)
    assert any("dta/tree_tokens" in entry for entry in dta.logs), "no micro-batch ran through DTA"
    assert all(entry.get("dta/dense_fallback", 0.0) == 0.0 for entry in dta.logs)
    assert_equivalent(ref, dta)
    rows = sum(len(b["prompt_ids"]) for b in dta.trainer._buffered_inputs)
    if layout == "per_turn":
        assert rows > 2 * G  # several turns per episode became rows
    if tool_loop:  # the tool loop ran mock's real tools: the gold variant of each task solved it
        rewards = [entry["rewards/Tau2MockEnv/mean"] if "rewards/Tau2MockEnv/mean" in entry else
                   entry.get("rewards/tau2_tool_reward/mean") for entry in dta.logs]
        assert rewards[0] is not None and 0.0 < rewards[0] < 1.0

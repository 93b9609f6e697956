"""The stand-in retail domain's episodes on the shared rollout loop: one [`RetailEnv`] played in the plain-text
protocol (`say ...` / `call tool key=value ...`, `protocol.py`) or in a chat model's template (`chat_turns.py`), as a
`Session` of `envs.core.rollout` ([`play_episodes`]). The loop, its limits and tree rollouts are described there.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...generation import Generator
from ..core.rollout import Episode, check_copyable, play_tasks
from .env import RetailDomain, RetailEnv
from .protocol import render_reply


class _TextSession:
    """A retail episode ([`RetailEnv`]) in the plain-text protocol, as a `Session` of `envs.core.rollout`."""

    def __init__(self, env: RetailEnv, prompt_ids: list[int], tokenizer, chat=None):
        self.env, self.prompt_ids, self.tokenizer, self.chat = env, prompt_ids, tokenizer, chat

    @property
    def done(self) -> bool:
        return self.env.done

    def step(self, turn_ids: list[int]) -> list[int]:
        role, text = self.env.step(self.tokenizer.decode(turn_ids, skip_special_tokens=True))
        if self.env.done:
            return []
        if self.chat is not None:
            return self.chat.reply_ids(role, text)
        return self.tokenizer(render_reply(role, text), add_special_tokens=False)["input_ids"]

    def stop(self, reason: str) -> None:
        self.env.stop(reason)

    def copy(self) -> _TextSession:
        """The same episode from here on, in an independent environment (tree rollouts)."""
        return _TextSession(self.env.copy(), self.prompt_ids, self.tokenizer, self.chat)


def play_episodes(
    domain: RetailDomain,
    task_ids: Sequence[int],
    generate: Generator,
    tokenizer,
    *,
    num_generations: int = 1,
    max_turns: int = 8,
    max_turn_tokens: int = 64,
    max_tokens: int = 1024,
    branching: Sequence[int] | None = None,
    branch_turns: int = 1,
    timings: dict | None = None,
    chat=None,
) -> list[Episode]:
    """Plays `num_generations` episodes of every task of the stand-in retail domain with the policy behind `generate`
    (or, with `branching`, a tree of `prod(branching)` episodes per task: `envs.core.rollout.play_tasks`).

    Args:
        domain ([`~envs.retail.env.RetailDomain`]): the domain.
        task_ids (`Sequence[int]`): the tasks; repeats are allowed (TRL passes each prompt `num_generations` times).
        generate ([`~trl_dta.generation.Generator`]): the policy, one turn per prefix (see
            `envs.core.rollout.run_sessions`; e.g. [`~trl_dta.generation.reprefill_generate_fn`]).
        tokenizer: the policy's tokenizer (prompt with special tokens, replies without; turns decoded without).
        num_generations (`int`, *optional*, defaults to `1`): episodes per task.
        max_turns (`int`, *optional*, defaults to `8`): agent turns per episode.
        max_turn_tokens (`int`, *optional*, defaults to `64`): tokens per agent turn (the longest gold call of the
            retail domain is about 50 characters).
        max_tokens (`int`, *optional*, defaults to `1024`): tokens per episode, prompt included.
        branching (`Sequence[int]`, *optional*): tree rollouts: episodes per level (`num_generations` must be 1).
        branch_turns (`int`, *optional*, defaults to `1`): agent turns per level before each branch point.
        timings (`dict`, *optional*): receives `"reward_s"`, the seconds spent grading.
        chat ([`~envs.retail.chat_turns.ChatTurns`], *optional*): play the protocol in a chat model's template (prompts
            and replies rendered as chat messages); `None`: the plain-text protocol (`envs.retail.protocol`).

    Returns:
        `list[Episode]`: `len(task_ids) * num_generations` episodes (`len(task_ids) * prod(branching)` with
        `branching`), those of a task next to each other.
    """
    prompts: dict[int, list[int]] = {}  # tokenized once per task

    def new_session(task_id: int) -> _TextSession:
        if task_id not in prompts:
            prompts[task_id] = (tokenizer(domain.prompt(task_id))["input_ids"] if chat is None
                                else chat.prompt_ids(task_id))
        env = domain.episode(task_id, max_turns=max_turns)
        if branching is not None:
            check_copyable(env)  # the session's `copy()` copies its environment
        return _TextSession(env, prompts[task_id], tokenizer, chat)

    def grade(episode: Episode, session: _TextSession) -> None:
        env = session.env
        episode.messages, episode.end_reason, episode.reward = list(env.messages), env.end_reason, env.reward()

    return play_tasks([domain.task(task_id).task_id for task_id in task_ids], new_session, generate, grade,
                      num_generations=num_generations, max_turn_tokens=max_turn_tokens, max_tokens=max_tokens,
                      branching=branching, branch_turns=branch_turns, timings=timings)

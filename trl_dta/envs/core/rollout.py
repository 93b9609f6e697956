"""Multi-turn rollouts: the policy plays episodes of a domain, token in, token out.

An episode is one token sequence that grows turn by turn. The policy's tokens are generated; everything else (the
prompt, tool answers, user replies, each with the next `agent: ` header) is tokenized from the environment's text and
appended. The rollout keeps, per episode, which token came from where and where each agent turn lies:

```
ids:      [ prompt ........ ][turn 0][ tool reply ][turn 1][ user reply ][turn 2]
env_mask:  0 0 0 ........ 0  1 1 1   0 0 0 0 0 0   1 1 1 1  0 0 0 0 0 0   1 1
turns:                       [s0,e0)               [s1,e1)                [s2,e2)
```

Turn `k` was generated from exactly `ids[:s_k]` (its prefix) and is `ids[s_k:e_k]`. So the episode layout (one
training sequence per episode, environment tokens masked: TRL's `env_mask`) and the per-turn layout (one sequence per
turn, `ids[:e_k]`, completion = the turn) come from the same record; the per-turn sequences of an episode are nested
prefixes of each other, and all episodes of a domain share the system prompt.

The loop is domain-free ([`run_sessions`] over [`Session`]s: prompt ids, `step(turn ids) -> reply ids`), and so is
an episode's set-up ([`play_tasks`]: sessions per task, the loop, the grading, timed); the stand-in retail domain's
text protocol is one kind of session (`trl_dta.envs.retail.episode`), tau2-bench's chat-template episodes another
(`trl_dta.envs.tau2.episode`). Episodes run in lockstep: each round asks the generator for one
turn of every unfinished episode in one batch. The last token of an episode is always a policy token: the reply
that ends an episode (the user's `(stop)`, or the answer to the last allowed turn) stays in `messages` but is not
tokenized, as nothing would be generated after it.

Tree rollouts (`branching=[b_0, b_1, ...]`, `branch_turns=k`): a task's episodes share their first turns and then
diverge. `b_0` episodes start from the prompt; after every `k` agent turns (at a turn boundary: the environment's
reply appended, the next agent turn not yet sampled) each unfinished episode is copied `b_{l+1}` times, its environment
with it (`env.copy()`, the [`CopyableEnv`] protocol), and the copies play on independently. An episode that ended
before a branch point stands for all the rows below it (copies of the same finished episode, each an honest sample).
A task then yields `prod(branching)` episodes in depth-first order; shared turns are sampled once, and DTA trains the
shared conversation once. Environments without `copy()` are refused.

Limits: at most `max_turns` agent turns, at most `max_turn_tokens` tokens per turn (the generator stops earlier at
its end-of-turn token), and never more than `max_tokens` tokens in an episode: a turn gets at most the tokens left,
and a reply that would leave no token for the next turn ends the episode (`"max_tokens"`) instead of being appended.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..._checks import check_int
from ...batch import SAMPLE_LAYOUTS
from ...generation import Generator


@runtime_checkable
class CopyableEnv(Protocol):
    """What tree rollouts need of an episode's environment (`RetailEnv` and `Tau2Session` implement it).

    - `step(turn: str) -> (role, text)`: play one agent turn, answer it;
    - `done: bool`, `stop(reason)`, `messages`, `end_reason`, `reward()`: as `RetailEnv`;
    - `copy() -> CopyableEnv`: an independent environment whose future, from now on, is distributed as this one's
      (same state: database, tool session, user simulator state and its random generator, conversation); stepping one
      never changes the other.
    """

    done: bool

    def step(self, turn: str) -> tuple[str, str]: ...

    def copy(self) -> CopyableEnv: ...


def check_branching(branching, branch_turns: int = 1) -> tuple[list[int] | None, int]:
    """`branching` as a list of positive ints (or None) and `branch_turns` as a positive int; errors name the fix."""
    branch_turns = check_int("branch_turns", branch_turns, minimum=1, hint="agent turns per segment")
    if branching is None:
        return None, branch_turns
    if isinstance(branching, (str, bytes)) or not hasattr(branching, "__iter__"):
        raise TypeError(f"`branching` must be a list of positive integers (episodes per level, e.g. [2, 2]) or None, "
                        f"got {branching!r}.")
    branching = [check_int("branching[]", b, minimum=1) for b in branching]
    if not branching:
        raise ValueError("`branching` must list at least one level (e.g. [2, 2]), or be None.")
    return branching, branch_turns


def check_copyable(env) -> None:
    """Refuse an environment that tree rollouts cannot branch."""
    if not callable(getattr(env, "copy", None)):
        raise ValueError(
            f"tree rollouts branch episodes by copying their environment, but {type(env).__name__} has no `copy()` "
            "(see `trl_dta.envs.core.rollout.CopyableEnv`): implement it, or play independent episodes "
            "(`branching=None`)."
        )


@dataclass(frozen=True)
class Turn:
    """One agent turn of an episode: tokens `ids[start:end]`, generated from the prefix `ids[:start]`."""

    start: int
    end: int


@dataclass
class Episode:
    """A finished episode.

    Args:
        task_id (`int` or `str`): its task.
        ids (`list[int]`): the whole conversation, prompt included, `(n_tokens,)`.
        env_mask (`list[int]`): `(n_tokens,)`, 1 for tokens the policy generated, 0 for prompt and environment tokens
            (TRL's `env_mask`/`tool_mask` convention).
        logprobs (`list[float]` or `None`): `(n_tokens,)`, the sampling log-prob of each policy token, 0.0 elsewhere;
            `None` when the generator gives none.
        prompt_length (`int`): tokens of the prompt (system prompt, ticket line, opening, first agent header).
        turns (`list[Turn]`): the agent turns, in order.
        messages (`list[tuple[str, str]]`): the conversation after the prompt as text, `(role, text)`.
        end_reason (`str`): `"user_stop"`, `"max_turns"` or `"max_tokens"`.
        reward: the episode's grade: a `RewardBreakdown` for the stand-in retail domain (`envs.retail.reward`),
            tau2's `RewardInfo` for the tau2 domains (both have `.reward`).
        shaped (`dict[str, float]`, *optional*): tau2 episodes: the shaped credits (`call_format`, `tools`,
            `arguments`; the stand-in's are in its `RewardBreakdown`).
    """

    task_id: int | str
    ids: list[int]
    env_mask: list[int]
    logprobs: list[float] | None
    prompt_length: int
    turns: list[Turn] = field(default_factory=list)
    messages: list[tuple[str, str]] = field(default_factory=list)
    end_reason: str = ""
    reward: object = None
    shaped: dict | None = None


def _append(episode: Episode, ids: Sequence[int], from_policy: bool, logprobs: Sequence[float] | None) -> None:
    episode.ids.extend(ids)
    episode.env_mask.extend([int(from_policy)] * len(ids))
    if episode.logprobs is not None:
        episode.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


class Session(Protocol):
    """One episode as the rollout drives it: token ids in, token ids out (see [`run_sessions`]).

    Attributes:
        prompt_ids (`list[int]`): the episode's prompt.
        done (`bool`): whether the episode has ended (after `step` or `stop`).
    """

    prompt_ids: list[int]
    done: bool

    def step(self, turn_ids: list[int]) -> list[int]:
        """Plays one policy turn; returns the environment's answer as token ids, ending with the next turn's header
        (ignored once `done`)."""

    def stop(self, reason: str) -> None:
        """Ends the episode for a reason of the rollout's (`"max_tokens"`)."""


def run_sessions(
    sessions: Sequence[Session],
    task_ids: Sequence,
    generate: Generator,
    *,
    max_turn_tokens: int = 64,
    max_tokens: int = 1024,
    branching: Sequence[int] | None = None,
    branch_turns: int = 1,
) -> tuple[list[Episode], list[Session]]:
    """Plays `sessions` in lockstep with the policy behind `generate`: the rollout loop shared by every domain.

    Args:
        sessions (`Sequence[Session]`): fresh episodes, one per rollout.
        task_ids (`Sequence`): the task of each session (kept in `Episode.task_id`).
        generate ([`~trl_dta.generation.Generator`]): the policy; the loop calls only
            `generate(prefixes, max_new_tokens) -> list[Generation]` (one sample per prefix, so any function of that
            signature serves), one turn per prefix, at most `max_new_tokens[i]` (and at least one) token ids each,
            normally ending with the end-of-turn token (e.g. [`~trl_dta.generation.reprefill_generate_fn`]). A later
            call's prefixes extend an earlier call's prefixes and turns, and branching episodes repeat a prefix: shared
            prefixes a generator can reuse.
        max_turn_tokens (`int`, *optional*, defaults to `64`): tokens per policy turn.
        max_tokens (`int`, *optional*, defaults to `1024`): tokens per episode, prompt included.
        branching (`Sequence[int]`, *optional*): tree rollouts: children per level; `sessions` then hold
            `branching[0]` sessions per tree (the first level), which must have `copy()` (see [`CopyableEnv`]).
        branch_turns (`int`, *optional*, defaults to `1`): policy turns per level before each branch point.

    Returns:
        `(episodes, sessions)`: the episodes, without `messages`, `end_reason` and `reward` (the domain's to fill),
        and the session each was played in (with `branching`, the grown list: `prod(branching[1:])` per input
        session, an episode that ended before a branch point repeated for every row below it).
    """
    max_turn_tokens = check_int("max_turn_tokens", max_turn_tokens, minimum=1)
    max_tokens = check_int("max_tokens", max_tokens, minimum=2)
    branching, branch_turns = check_branching(branching, branch_turns)
    episodes = []
    for session, task_id in zip(sessions, task_ids, strict=True):
        prompt_ids = list(session.prompt_ids)
        if len(prompt_ids) >= max_tokens:
            raise ValueError(
                f"the prompt of task {task_id} has {len(prompt_ids)} tokens, which leaves no room for a turn within "
                f"`max_tokens={max_tokens}`; raise `max_tokens` or shorten the system prompt."
            )
        episodes.append(Episode(task_id, prompt_ids, [0] * len(prompt_ids), [0.0] * len(prompt_ids),
                                len(prompt_ids)))
    sessions = list(sessions)
    levels = [0] * len(sessions)  # branch points each episode has passed
    while True:
        if branching is not None:
            episodes, sessions, levels = _branch(episodes, sessions, levels, branching, branch_turns)
        active = [i for i, session in enumerate(sessions) if not session.done]
        if not active:
            break
        budgets = [min(max_turn_tokens, max_tokens - len(episodes[i].ids)) for i in active]
        outputs = generate([list(episodes[i].ids) for i in active], budgets)
        if len(outputs) != len(active):
            raise ValueError(f"`generate` returned {len(outputs)} generations for {len(active)} prefixes.")
        for i, output, budget in zip(active, outputs, budgets):
            episode, session = episodes[i], sessions[i]
            if not 1 <= len(output.ids) <= budget:
                raise ValueError(f"`generate` returned {len(output.ids)} tokens for a turn limited to {budget}; it "
                                 "must return between 1 and max_new_tokens tokens per prefix.")
            if output.logprobs is None:
                episode.logprobs = None
            elif len(output.logprobs) != len(output.ids):
                raise ValueError("`generate` returned log-probs and token ids of different lengths.")
            start = len(episode.ids)
            _append(episode, output.ids, True, output.logprobs)
            episode.turns.append(Turn(start, len(episode.ids)))
            reply = session.step(list(output.ids))
            if session.done:
                continue
            if len(episode.ids) + len(reply) >= max_tokens:
                session.stop("max_tokens")
                continue
            _append(episode, reply, False, None)
    if branching is not None:  # episodes that ended before a branch point stand for all the rows below them
        copies = [math.prod(branching[level + 1:]) for level in levels]
        episodes = [copy.deepcopy(e) for e, n in zip(episodes, copies) for _ in range(n)]
        sessions = [s for s, n in zip(sessions, copies) for _ in range(n)]
    return episodes, sessions


def play_tasks(
    task_ids: Sequence,
    new_session: Callable[[object], Session],
    generate: Generator,
    grade: Callable[[Episode, Session], None],
    *,
    num_generations: int = 1,
    max_turn_tokens: int = 64,
    max_tokens: int = 1024,
    branching: Sequence[int] | None = None,
    branch_turns: int = 1,
    timings: dict | None = None,
) -> list[Episode]:
    """Plays `num_generations` episodes of every task (or, with `branching`, a tree of `prod(branching)` episodes per
    task, see the module docstring): the episode set-up every domain shares, around [`run_sessions`].

    Args:
        task_ids (`Sequence`): the tasks; repeats are allowed (TRL passes each prompt `num_generations` times).
        new_session (`Callable`): `new_session(task_id) -> Session`, a fresh episode of the task (with `branching`,
            one that has `copy()`, see [`CopyableEnv`]).
        generate ([`~trl_dta.generation.Generator`]): the policy (see [`run_sessions`]).
        grade (`Callable`): `grade(episode, session)`, called once per played episode: fills the episode's
            `messages`, `end_reason`, `reward` (and `shaped`) from its session.
        num_generations (`int`, *optional*, defaults to `1`): episodes per task.
        max_turn_tokens (`int`, *optional*, defaults to `64`): tokens per policy turn.
        max_tokens (`int`, *optional*, defaults to `1024`): tokens per episode, prompt included.
        branching (`Sequence[int]`, *optional*): tree rollouts: episodes per level (`num_generations` must be 1).
        branch_turns (`int`, *optional*, defaults to `1`): policy turns per level before each branch point.
        timings (`dict`, *optional*): receives `"reward_s"`, the seconds spent in `grade`.

    Returns:
        `list[Episode]`: `len(task_ids) * num_generations` episodes (`len(task_ids) * prod(branching)` with
        `branching`), those of a task next to each other.
    """
    num_generations = check_int("num_generations", num_generations, minimum=1)
    branching, branch_turns = check_branching(branching, branch_turns)
    if branching is not None and num_generations != 1:
        raise ValueError(f"with `branching` each task yields prod(branching) episodes: set `num_generations=1` "
                         f"(got {num_generations}).")
    sessions, ids = [], []
    for task_id in task_ids:
        for _ in range((branching or [num_generations])[0]):
            sessions.append(new_session(task_id))
            if branching is not None:
                check_copyable(sessions[-1])
            ids.append(task_id)
    episodes, sessions = run_sessions(sessions, ids, generate, max_turn_tokens=max_turn_tokens, max_tokens=max_tokens,
                                      branching=branching, branch_turns=branch_turns)
    start = time.perf_counter()
    for episode, session in zip(episodes, sessions):
        grade(episode, session)
    if timings is not None:
        timings["reward_s"] = time.perf_counter() - start
    return episodes


def _branch(episodes: list[Episode], sessions: list, levels: list[int], branching: list[int], branch_turns: int):
    """Copy every unfinished episode that reached its next branch point (`branch_turns` agent turns per level) into
    the next level's number of children, in place in the depth-first order."""
    out_episodes, out_sessions, out_levels = [], [], []
    for episode, session, level in zip(episodes, sessions, levels):
        if session.done or level + 1 >= len(branching) or len(episode.turns) < branch_turns * (level + 1):
            out_episodes.append(episode), out_sessions.append(session), out_levels.append(level)
            continue
        for child in range(branching[level + 1]):
            out_episodes.append(episode if child == 0 else copy.deepcopy(episode))
            out_sessions.append(session if child == 0 else session.copy())
            out_levels.append(level + 1)
    return out_episodes, out_sessions, out_levels


def layout_sequences(episodes: Sequence[Episode], layout: str) -> list[list[int]]:
    """The training sequences of a batch of episodes in one of the two layouts.

    Args:
        episodes (`Sequence[Episode]`): the episodes.
        layout (`str`): `"episode"`: one sequence per episode, its whole `ids`; `"per_turn"`: one sequence per agent
            turn, the conversation up to and including that turn (`ids[:turn.end]`), so an episode's sequences are
            nested prefixes of each other.

    Returns:
        `list[list[int]]`: the sequences, episode by episode (and turn by turn).
    """
    if layout not in SAMPLE_LAYOUTS:
        raise ValueError(f"`layout` must be one of {SAMPLE_LAYOUTS}, got {layout!r}.")
    if layout == "episode":
        return [list(e.ids) for e in episodes]
    return [e.ids[:turn.end] for e in episodes for turn in e.turns]

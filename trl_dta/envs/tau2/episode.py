"""One tau2 episode in the policy's chat template, token in, token out, and the multi-turn rollout over a domain.

[`Tau2Session`] is a [`~envs.core.rollout.Session`]: the shared rollout loop (`envs.core.rollout.run_sessions`) hands it
each generated turn as token ids and appends what it answers. A turn is read with the template's response parser
([`~envs.core.chat.ChatRenderer.parse`]):

```
turn with tool calls  -> each call runs on the episode's database (tau2's Environment.get_response)
                         -> tool results, rendered as the template's tool messages            (masked)
turn with text only   -> the user answers (ScriptedUser offline, or tau2's LLM user)           (masked)
                         -> a reply with ###STOP### ends the episode ("user_stop")
malformed <tool_call> -> a tool message "Error: ..." and the episode goes on
```

tau2's own error texts answer an unknown tool or bad arguments ("Error: Tool 'x' not found."), as tau2's orchestrator
answers them. The episode keeps its tau2 trajectory (assistant messages with tool calls, tool messages, user
messages) and is graded by tau2's evaluator ([`~envs.tau2.domain.Tau2Domain.evaluate`]) when it ends: `"user_stop"`
is graded; `"max_turns"` and `"max_tokens"` are tau2's `max_steps`, which scores 0.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from ..._checks import check_int
from ...generation import Generator
from ..core.chat import ChatRenderer
from ..core.credits import argument_credit, common_prefix, tool_credit
from ..core.rollout import Episode, play_tasks
from ._seam import tau2_modules
from .domain import Tau2Domain, call_tool, chat_tool_message, tau2_assistant_message
from .user import ScriptedUser

END_REASONS = ("user_stop", "max_turns", "max_tokens")
_TAU2_END = {"user_stop": "user_stop", "max_turns": "max_steps", "max_tokens": "max_steps"}
_TOOL_CALL_OPEN = "<tool_call>"
_UNPARSED = 0.25  # the call format of a turn with a `<tool_call>` that does not parse


class Tau2Session:
    """One episode of a tau2 task (see the module docstring).

    Args:
        domain ([`Tau2Domain`]): the domain.
        task_id (`str`): the task.
        renderer ([`~envs.core.chat.ChatRenderer`]): the policy's chat template with the domain's tools.
        user: a user with `opening` and `reply(text) -> (text, stop)`; defaults to [`ScriptedUser`]`(task, seed)`.
        seed (`int`, *optional*, defaults to `0`): the scripted user's seed.
        max_turns (`int`, *optional*, defaults to `16`): policy turns after which the episode ends.
        demonstration (`Sequence[dict]`, *optional*): chat messages shown between the system prompt and the user's
            opening ([`gold_demonstration`]); part of the prompt, not of the trajectory tau2 grades.
    """

    def __init__(self, domain: Tau2Domain, task_id: str, renderer: ChatRenderer, user=None, seed: int = 0,
                 max_turns: int = 16, demonstration: Sequence[dict] = ()):
        self.domain, self.renderer = domain, renderer
        self.task = domain.task(task_id)
        self.user = user if user is not None else ScriptedUser(self.task, seed)
        if hasattr(self.user, "act"):
            self.user.act = self._user_action
        self.max_turns = check_int("max_turns", max_turns, minimum=1)
        self.env = domain.new_environment(self.task)
        m = tau2_modules().message
        self._m = m
        self.trajectory = domain.initial_messages(self.task) + [m.UserMessage(role="user", content=self.user.opening)]
        self.chat = [{"role": "system", "content": domain.system_prompt}, *copy.deepcopy(list(demonstration)),
                     {"role": "user", "content": self.user.opening}]
        self.prompt_messages = len(self.chat)
        self.prompt_ids = renderer.prompt_ids(self.chat)
        self._header = self._after_last_eos(self.prompt_ids)  # the next turn's header: the response parser's prefix
        self.done, self.end_reason, self.turns = False, None, 0
        self._calls = 0
        self.calls: list[tuple[str, dict]] = []  # the agent's attempted calls, for the shaped rewards
        self.call_formats: list[float] = []  # per turn: see `shaped`

    def step(self, turn_ids: list[int]) -> list[int]:
        if self.done:
            raise ValueError(f"the episode has ended ({self.end_reason}).")
        self.turns += 1
        message = self.renderer.parse(turn_ids, prefix=self._header)
        self.chat.append(message)
        if message.get("tool_calls"):
            known = {s["function"]["name"] for s in self.domain.tool_schemas}
            names = [c.get("function", c).get("name") for c in message["tool_calls"]]
            self.call_formats.append(1.0 if all(n in known for n in names) else 0.5)
            answers = self._run_calls(message)
        elif _TOOL_CALL_OPEN in message["content"]:
            self.call_formats.append(_UNPARSED)
            answers = [{"role": "tool", "name": "error", "content": "Error: the tool call could not be parsed; write "
                        "one JSON object with 'name' and 'arguments' inside <tool_call></tool_call>."}]
        else:  # text: partial credit for the share of `<tool_call>` it starts with (`<tool_response>`: 6/11)
            opening = common_prefix(message["content"].lstrip(), _TOOL_CALL_OPEN) / len(_TOOL_CALL_OPEN)
            self.call_formats.append(_UNPARSED * opening)
            self.trajectory.append(tau2_assistant_message(message))
            text, stop = self.user.reply(message["content"])
            self.trajectory.append(self._m.UserMessage(role="user", content=text))
            answers = [{"role": "user", "content": text}]
            if stop:
                self.stop("user_stop")
        self.chat.extend(answers)
        if not self.done and self.turns >= self.max_turns:
            self.stop("max_turns")
        if self.done:
            return []
        reply = self.renderer.suffix_ids(answers)
        self._header = self._after_last_eos(reply)
        return reply

    def _after_last_eos(self, ids: list[int]) -> list[int]:
        eos = self.renderer.tokenizer.eos_token_id
        last = max((i for i, token in enumerate(ids) if token == eos), default=-1)
        return list(ids[last + 1:])

    def _run_calls(self, message: dict) -> list[dict]:
        calls, results, answers = [], [], []
        for call in message["tool_calls"]:
            function = call.get("function", call)
            self._calls += 1
            tool_call, result = call_tool(self.env, function.get("name", ""), function.get("arguments", {}),
                                          f"call_{self._calls}")
            self.calls.append((tool_call.name, dict(tool_call.arguments)))
            calls.append(tool_call)
            results.append(result)
            answers.append(chat_tool_message(tool_call.name, result))
        self.trajectory.append(tau2_assistant_message(message, calls))
        self.trajectory.extend(results)
        return answers

    def _user_action(self, name: str, arguments: dict) -> str:
        """Runs one of the user's own actions on the episode's environment, as tau2's user simulator does (a user
        message with the tool call, then the tool's answer, both in the trajectory); returns the answer's text."""
        m = self._m
        self._calls += 1
        call = m.ToolCall(id=f"user_call_{self._calls}", name=name, arguments=arguments, requestor="user")
        result = self.env.get_response(call)
        self.trajectory.append(m.UserMessage(role="user", tool_calls=[call]))
        self.trajectory.append(result)
        return (result.content or "")[:300]

    def copy(self) -> Tau2Session:
        """The same episode from here on, independent of this one (tree rollouts branch episodes at turn boundaries
        with it: `envs.core.rollout.CopyableEnv`): the database copied ([`Tau2Domain.copy_environment`]), the user's
        state copied (its `copy()`), the conversation and trajectory copied; domain, task and renderer shared."""
        twin = copy.copy(self)
        twin.env = self.domain.copy_environment(self.env)
        twin.user = self.user.copy() if callable(getattr(self.user, "copy", None)) else copy.deepcopy(self.user)
        if hasattr(twin.user, "act"):  # the user's own actions run on the twin's database
            twin.user.act = twin._user_action
        twin.trajectory, twin.chat = list(self.trajectory), copy.deepcopy(self.chat)
        twin.prompt_ids, twin._header = list(self.prompt_ids), list(self._header)
        twin.calls, twin.call_formats = list(self.calls), list(self.call_formats)
        return twin

    def stop(self, reason: str) -> None:
        if reason not in END_REASONS:
            raise ValueError(f"`reason` must be one of {END_REASONS}, got {reason!r}.")
        self.done, self.end_reason = True, reason

    def reward(self):
        """tau2's `RewardInfo` for the episode so far (final once `done`)."""
        return self.domain.evaluate(self.task, self.trajectory, _TAU2_END.get(self.end_reason, "max_steps"))

    def shaped(self) -> dict[str, float]:
        """The shaped credits of the episode (`envs.core.credits`): `call_format` (the mean per-turn call format: 1 a
        call of a known tool, 0.5 of an unknown one, 0.25 an unparsed `<tool_call>`, text `0.25 * lcp / 11` for the
        share of `<tool_call>` it starts with, as the stand-in credits a turn's start of `call `), `tools` and
        `arguments` against the task's gold agent actions."""
        criteria = self.task.evaluation_criteria
        gold = [(a.name, dict(a.arguments)) for a in (criteria.actions or []) if a.requestor == "assistant"] \
            if criteria is not None else []
        formats = self.call_formats
        return {"call_format": sum(formats) / len(formats) if formats else 0.0,
                "tools": tool_credit(gold, self.calls), "arguments": argument_credit(gold, self.calls)}


def play_tau2_episodes(
    domain: Tau2Domain,
    task_ids: Sequence[str],
    generate: Generator,
    renderer: ChatRenderer,
    *,
    num_generations: int = 1,
    seed: int = 0,
    user_factory=None,
    max_turns: int = 16,
    max_turn_tokens: int = 256,
    max_tokens: int = 32768,
    timings: dict | None = None,
    branching: Sequence[int] | None = None,
    branch_turns: int = 1,
    demonstration: Sequence[dict] = (),
) -> list[Episode]:
    """Plays `num_generations` episodes of every task with the policy behind `generate` (or, with `branching`, a tree
    of `prod(branching)` episodes per task that branches at turn boundaries: `envs.core.rollout.run_sessions`).

    Args:
        domain ([`Tau2Domain`]): the domain.
        task_ids (`Sequence[str]`): tau2 task ids; repeats allowed (TRL passes each prompt `num_generations` times).
        generate ([`~trl_dta.generation.Generator`]): the policy, one turn per prefix
            (`trl_dta.generation.reprefill_generate_fn` with the template's eos).
        renderer ([`~envs.core.chat.ChatRenderer`]): the policy's chat template with `domain.tool_schemas`.
        num_generations (`int`, *optional*, defaults to `1`): episodes per task.
        seed (`int`, *optional*, defaults to `0`): the scripted users' seed.
        user_factory (*optional*): `user_factory(task) -> user` (e.g. an [`~envs.tau2.user.LLMUser`]); defaults to
            [`ScriptedUser`]`(task, seed)`.
        max_turns (`int`, *optional*, defaults to `16`): the episode's limit of policy turns.
        max_turn_tokens (`int`, *optional*, defaults to `256`): the episode's limit of tokens per turn.
        max_tokens (`int`, *optional*, defaults to `32768`): the episode's limit of tokens in all.
        timings (`dict`, *optional*): receives `"reward_s"`, the seconds tau2's evaluator took.
        branching (`Sequence[int]`, *optional*): tree rollouts: episodes per level (`num_generations` must be 1);
            every unfinished episode is copied ([`Tau2Session.copy`]) into the next level's children after
            `branch_turns` policy turns per level.
        branch_turns (`int`, *optional*, defaults to `1`): policy turns per level before each branch point.
        demonstration (`Sequence[dict]`, *optional*): chat messages before each opening ([`gold_demonstration`]).

    Returns:
        `list[Episode]`: with `messages` (the chat messages after the prompt), `end_reason`, `reward` (tau2's
        `RewardInfo`) and `shaped` ([`Tau2Session.shaped`]).
    """
    def new_session(task_id: str) -> Tau2Session:
        user = user_factory(domain.task(task_id)) if user_factory is not None else None
        return Tau2Session(domain, task_id, renderer, user=user, seed=seed, max_turns=max_turns,
                           demonstration=demonstration)

    def grade(episode: Episode, session: Tau2Session) -> None:
        episode.messages, episode.end_reason = session.chat[session.prompt_messages:], session.end_reason
        episode.reward = session.reward()
        episode.shaped = session.shaped()

    return play_tasks(task_ids, new_session, generate, grade, num_generations=num_generations,
                      max_turn_tokens=max_turn_tokens, max_tokens=max_tokens, branching=branching,
                      branch_turns=branch_turns, timings=timings)


def gold_demonstration(domain: Tau2Domain, task_id: str, seed: int = 0) -> list[dict]:
    """One solved episode of a task as chat messages, to show a small model the tool-call format before its own task:
    the scripted user's opening, then each gold agent action as an assistant tool call followed by the answer of
    tau2's tool on a fresh database, then the gold closing message ([`Tau2Domain.gold_turns`]).

    Use a task that is not trained on (the recipe holds it out), so the demonstration shows the format and the
    domain's tools, not the answer.

    Args:
        domain ([`Tau2Domain`]): the domain.
        task_id (`str`): the task; its gold actions must all be the agent's (no user actions).
        seed (`int`, *optional*, defaults to `0`): the scripted user's seed (its opening).

    Returns:
        `list[dict]`: user, assistant (tool calls), tool, ..., assistant messages.
    """
    task = domain.task(task_id)
    criteria = task.evaluation_criteria
    actions = list(criteria.actions or []) if criteria is not None else []
    if not actions or any(a.requestor != "assistant" for a in actions):
        raise ValueError(f"task {task_id!r} has no gold actions or has user actions; pick a task solved by the agent's "
                         "tool calls alone for the demonstration.")
    env = domain.new_environment(task)
    messages = [{"role": "user", "content": ScriptedUser(task, seed).opening}]
    for k, turn in enumerate(domain.gold_turns(task)):
        messages.append(turn)
        for call in turn.get("tool_calls", []):
            function = call["function"]
            tool_call, result = call_tool(env, function["name"], function["arguments"], f"demo_{k}")
            messages.append(chat_tool_message(tool_call.name, result))
    return messages

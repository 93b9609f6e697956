"""The users of a tau2 episode: an offline scripted user for CPU and tests, and tau2's LLM user simulator.

tau2-bench plays the customer with an LLM (`tau2.user.user_simulator.UserSimulator`, through litellm) that follows
the task's `user_scenario`: the reason for the call, what the user knows, the task instructions; it ends the call with
tau2's stop marker `###STOP###`. Offline, [`ScriptedUser`] plays the same scenario from a script:

```
opening  = reason_for_call (+ the first k facts of known_info, k drawn from the seed)
reply(agent text):  asks to confirm ("confirm", "proceed", "yes or no", ...)  -> "Yes, please go ahead."
                    otherwise, while the user's own gold actions are left     -> runs the next group of them on the
                                                                                 phone, says what they returned
                    otherwise, while facts are left (known_info, then task_instructions) -> the next fact
                    no fact left, or `max_replies` reached                     -> "Thank you, that is all. ###STOP###"
```

Facts are the scenario's sentences in the first person ("You are Raj" -> "I am Raj"). The user's own actions
(telecom's phone actions: the task's gold actions with `requestor="user"`) come in groups: the consecutive user
actions between two agent actions of the gold sequence; each agent message that is not a confirmation question gets
the next group done (through the episode's `act`, which runs them on the episode's environment as tau2's user
simulator would, as user tool calls in the trajectory). A gold replay ([`~envs.tau2.domain.Tau2Domain.gold_turns`]
asks for each group where the gold sequence has it) therefore reaches the gold state. The user is deterministic given
`(seed, task id)` and the agent's messages, so two runs of the same policy samples play the same episodes.

[`LLMUser`] wraps tau2's `UserSimulator` for users with an endpoint (any litellm model name, e.g. `gpt-4.1` with
`OPENAI_API_KEY`, or a local OpenAI-compatible server as `openai/<model>` with `OPENAI_API_BASE`). It is not run by
the offline tests.
"""

from __future__ import annotations

import copy
import random
import re

from ._seam import tau2_modules

STOP = "###STOP###"  # tau2.user.base.STOP
_CONFIRM = re.compile(r"\b(confirm|proceed|go ahead|yes or no|shall i|should i|would you like|do you want)\b", re.I)
_PERSON = ((r"\bYou are\b", "I am"), (r"\byou are\b", "I am"), (r"\bYour\b", "My"), (r"\byour\b", "my"),
           (r"\bYou\b", "I"), (r"\byou\b", "me"), (r"\byourself\b", "myself"))


def _first_person(text: str) -> str:
    for pattern, replacement in _PERSON:
        text = re.sub(pattern, replacement, text)
    return text


def _sentences(text) -> list[str]:
    if not text:
        return []
    parts = re.split(r"(?<=[.!?])\s+|\n+", str(text))
    return [_first_person(p.strip()) for p in parts if p.strip()]


def user_action_groups(task) -> list[list[tuple[str, dict]]]:
    """The task's gold actions of the user (`requestor="user"`), grouped: consecutive ones between agent actions."""
    criteria = task.evaluation_criteria
    groups, current = [], []
    for action in (criteria.actions or []) if criteria is not None else []:
        if action.requestor == "user":
            current.append((action.name, dict(action.arguments)))
        elif current:
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


class ScriptedUser:
    """The offline user of one episode (see the module docstring).

    Args:
        task: tau2's `Task`.
        seed (`int`, *optional*, defaults to `0`): with the task id, fixes how many facts the opening volunteers.
        max_replies (`int`, *optional*, defaults to `8`): replies after which the user hangs up.

    Attributes:
        act (`Callable[[str, dict], str]`, *optional*): runs one of the user's own actions, returns its result text;
            set by the episode ([`~envs.tau2.episode.Tau2Session`]). Without it the user answers in text only.
    """

    def __init__(self, task, seed: int = 0, max_replies: int = 8):
        instructions = task.user_scenario.instructions
        if isinstance(instructions, str):
            reason, known, rest = instructions, [], []
        else:
            reason = instructions.reason_for_call
            known, rest = _sentences(instructions.known_info), _sentences(instructions.task_instructions)
        rng = random.Random(f"{seed}:{task.id}")
        volunteered = rng.randint(0, min(2, len(known)))
        self.opening = " ".join(_sentences(reason) + known[:volunteered]) or "Hi, I need help."
        self._facts = known[volunteered:] + rest
        self.max_replies = max_replies
        self.replies = 0
        self.act = None
        self._actions = user_action_groups(task)

    def copy(self) -> ScriptedUser:
        """The same user from here on (the facts not yet told, the replies counted), independent of this one."""
        twin = copy.copy(self)
        twin._facts, twin._actions = list(self._facts), list(self._actions)
        return twin

    def reply(self, agent_text: str) -> tuple[str, bool]:
        """The answer to an agent message: `(text, stop)`; `stop` is true when the text carries the stop marker."""
        self.replies += 1
        if self.replies > self.max_replies:
            return f"Thank you, that is all. {STOP}", True
        if _CONFIRM.search(agent_text or ""):
            return "Yes, please go ahead.", False
        if self._actions and self.act is not None:
            done = [f"{name}: {self.act(name, arguments)}" for name, arguments in self._actions.pop(0)]
            return "I did that on my phone. " + " ".join(done), False
        if self._facts:
            return self._facts.pop(0), False
        return f"Thank you, that is all. {STOP}", True


class LLMUser:
    """tau2's LLM user simulator (`UserSimulator`) behind the same `opening` / `reply` interface.

    Args:
        task: tau2's `Task` (its `user_scenario` becomes the simulator's instructions).
        llm (`str`): a litellm model name.
        llm_args (`dict`, *optional*): litellm arguments (temperature, api_base, ...).
        seed (`int`, *optional*): passed to litellm as `seed` where the endpoint supports it.
    """

    def __init__(self, task, llm: str, llm_args: dict | None = None, seed: int | None = None):
        from tau2.user.user_simulator import UserSimulator  # behind the seam: tau2_modules() ran first

        t = tau2_modules()
        args = dict(llm_args or {})
        if seed is not None:
            args.setdefault("seed", seed)
        self._user = UserSimulator(instructions=str(task.user_scenario), llm=llm, llm_args=args)
        self._state = self._user.get_init_state()
        self._message = t.message
        first, self._state = self._user.generate_next_message(
            t.message.AssistantMessage(role="assistant", content="Hi! How can I help you today?"), self._state)
        self.opening = first.content or ""

    def copy(self) -> LLMUser:
        """The same user from here on: the simulator shared, its conversation state (`UserState`) copied."""
        twin = copy.copy(self)
        twin._state = copy.deepcopy(self._state)
        return twin

    def reply(self, agent_text: str) -> tuple[str, bool]:
        message, self._state = self._user.generate_next_message(
            self._message.AssistantMessage(role="assistant", content=agent_text), self._state)
        return message.content or "", self._user.is_stop(message)

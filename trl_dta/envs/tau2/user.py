"""The users of a tau2 episode: an offline scripted user for CPU and tests, and tau2's LLM user simulator.

tau2-bench plays the customer with an LLM (`tau2.user.user_simulator.UserSimulator`, through litellm) that follows
the task's `user_scenario`: the reason for the call, what the user knows, the task instructions; it ends the call with
tau2's stop marker `###STOP###`. Offline, [`ScriptedUser`] plays the same scenario from a script:

```
opening  = reason_for_call (+ the first k facts of known_info, k drawn from the seed)
reply(agent text):  asks to confirm ("confirm", "proceed", "yes or no", ...)  -> "Yes, please go ahead."
                    otherwise, while facts are left (known_info, then task_instructions) -> the next fact
                    no fact left, or `max_replies` reached                     -> "Thank you, that is all. ###STOP###"
```

Facts are the scenario's sentences in the first person ("You are Raj" -> "I am Raj"). The user is deterministic
given `(seed, task id)` and the agent's messages, so two runs of the same policy samples play the same episodes. It
answers text only: user-side tools (telecom's phone actions) are not run, so telecom tasks whose gold actions include
the user's own actions cannot be solved with it.

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


class ScriptedUser:
    """The offline user of one episode (see the module docstring).

    Args:
        task: tau2's `Task`.
        seed (`int`, *optional*, defaults to `0`): with the task id, fixes how many facts the opening volunteers.
        max_replies (`int`, *optional*, defaults to `8`): replies after which the user hangs up.
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

    def copy(self) -> ScriptedUser:
        """The same user from here on (the facts not yet told, the replies counted), independent of this one."""
        twin = copy.copy(self)
        twin._facts = list(self._facts)
        return twin

    def reply(self, agent_text: str) -> tuple[str, bool]:
        """The answer to an agent message: `(text, stop)`; `stop` is true when the text carries the stop marker."""
        self.replies += 1
        if self.replies > self.max_replies:
            return f"Thank you, that is all. {STOP}", True
        if _CONFIRM.search(agent_text or ""):
            return "Yes, please go ahead.", False
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

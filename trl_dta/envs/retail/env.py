r"""The retail domain and one episode of it, at the level of text.

[`RetailDomain`] holds what all tasks of a domain share (the initial database, the policy document = the shared
system prompt) and makes tasks, prompts and episodes. [`RetailEnv`] is one episode: it takes the agent's turns as
text, one at a time, and answers each with one message:

```
agent turn --parse--> say <message> ----> user simulator ---> ("user", reply)      ends on (stop)
                  \-> call <tool> ... --> tool on the db ---> ("tool", answer)
                  \-> malformed -------------------------->  ("tool", "error: ...")
```

and scores the episode at the end ([`RetailEnv.reward`]). The episode ends when the user hangs up (`"user_stop"`) or
after `max_turns` agent turns (`"max_turns"`); the token limit is the rollout's business (it counts tokens), which
ends an episode through [`RetailEnv.stop`]. Nothing the agent writes can crash an episode: every bad turn is answered.
"""

from __future__ import annotations

import copy
import re
from functools import cached_property

from ..._checks import check_int
from .database import Database, Session, generate_database, run_tool
from .policy_document import policy_document
from .protocol import AGENT, TOOL, USER, Call, ProtocolError, Say, named_tool, parse_turn, render_prompt
from .reward import RewardBreakdown, compute_reward, info_said
from .tasks import Task, generate_task, gold_database
from .user import UserSimulator

END_REASONS = ("user_stop", "max_turns", "max_tokens")
_TICKET = re.compile(r"\nticket (\d+)\n")


class RetailDomain:
    """A retail customer-service domain: database, policy document and task generator, all fixed by `seed`.

    Args:
        seed (`int`, *optional*, defaults to `0`):
            Seed of the database, the tasks and the policy's filler clauses.
        num_users (`int`, *optional*, defaults to `16`):
            Users in the database (each with 1-3 orders).
        policy_chars (`int`, *optional*, defaults to `0`):
            Smallest length of the policy document in characters (see `policy.policy_document`): `0` gives the core
            document of about 500 characters, i.e. that many tokens with the tiny character tokenizer; benchmarks
            raise it to several thousand.
        patience (`int`, *optional*, defaults to `3`):
            Unanswerable agent messages in a row before the simulated user hangs up.
    """

    def __init__(self, seed: int = 0, num_users: int = 16, policy_chars: int = 0, patience: int = 3):
        self.seed = check_int("seed", seed, minimum=0)
        self.num_users = check_int("num_users", num_users, minimum=1)
        self.patience = check_int("patience", patience, minimum=1)
        self.database = generate_database(self.seed, self.num_users)
        self.system_prompt = policy_document(check_int("policy_chars", policy_chars, minimum=0), self.seed)
        self._tasks: dict[int, Task] = {}
        self._gold: dict[int, Database] = {}

    def task(self, task_id: int) -> Task:
        """Task `task_id` (any integer `>= 0`; drawn on first use, then cached)."""
        task_id = check_int("task_id", task_id, minimum=0)
        if task_id not in self._tasks:
            self._tasks[task_id] = generate_task(self.database, task_id, self.seed)
        return self._tasks[task_id]

    def gold_database(self, task_id: int) -> Database:
        """The database after task `task_id`'s gold actions (cached)."""
        if task_id not in self._gold:
            self._gold[task_id] = gold_database(self.database, self.task(task_id))
        return self._gold[task_id]

    def prompt(self, task_id: int) -> str:
        """The episode's prompt: the shared system prompt, the ticket line and the user's opening."""
        return render_prompt(self.system_prompt, task_id, self.task(task_id).opening)

    def task_id_of(self, prompt: str) -> int:
        """The task a prompt of this domain was made for (its ticket line); a `ValueError` for any other text."""
        match = _TICKET.search(prompt) if isinstance(prompt, str) else None
        if match is None or prompt != self.prompt(int(match.group(1))):
            raise ValueError(
                "the prompt was not made by this RetailDomain (no ticket line, or a different system prompt or "
                "opening); build the dataset with `trl_dta.envs.build_dataset(domain, ...)` from the same domain."
            )
        return int(match.group(1))

    def episode(self, task_id: int, max_turns: int = 8) -> RetailEnv:
        """A fresh episode of task `task_id`."""
        return RetailEnv(self, task_id, max_turns=max_turns)


class RetailEnv:
    """One episode of a retail task, played turn by turn in text.

    Args:
        domain ([`RetailDomain`]): the domain.
        task_id (`int`): the task.
        max_turns (`int`, *optional*, defaults to `8`): agent turns after which the episode ends.

    Attributes:
        messages (`list[tuple[str, str]]`): the conversation after the prompt, `(role, text)` with roles `agent`,
            `user`, `tool`; the last message may be a reply that ended the episode.
        done (`bool`), end_reason (`str` or `None`): whether and why the episode ended (one of `END_REASONS`).
    """

    def __init__(self, domain: RetailDomain, task_id: int, max_turns: int = 8):
        self.domain = domain
        self.task = domain.task(task_id)
        self.max_turns = check_int("max_turns", max_turns, minimum=1)
        self.db = domain.database.copy()
        self.session = Session()
        self.user = UserSimulator(self.task, domain.patience)
        self.messages: list[tuple[str, str]] = []
        self.done = False
        self.end_reason: str | None = None
        self._turns: list[str] = []
        self._said: list[str] = []
        self._executed: list[Call] = []
        self._attempted: list[Call] = []

    def step(self, turn: str) -> tuple[str, str]:
        """Plays one agent turn.

        Args:
            turn (`str`): the agent's turn as decoded (end-of-turn token removed).

        Returns:
            `tuple[str, str]`: the answer, `(role, text)` with role `user` or `tool`. After it, `done` tells whether
            the episode has ended (then nothing more is generated, and the answer is only kept in `messages`).
        """
        if self.done:
            raise ValueError(f"the episode has ended ({self.end_reason}); start a new one with domain.episode(...).")
        self._turns.append(turn)
        self.messages.append((AGENT, turn))
        try:
            action = parse_turn(turn)
        except ProtocolError as error:
            role, text = TOOL, str(error)
            tool = named_tool(turn)
            if tool is not None:  # arguments that do not parse: the call still names its tool (no arguments passed)
                self._attempted.append(Call.of(tool))
        else:
            role, text = self._act(action)
        self.messages.append((role, text))
        if not self.done and len(self._turns) >= self.max_turns:
            self.stop("max_turns")
        return role, text

    def _act(self, action: Say | Call) -> tuple[str, str]:
        if isinstance(action, Say):
            self._said.append(action.text)
            text, hung_up = self.user.reply(action.text, info_said(self.task.required_info, self._said) == 1.0)
            if hung_up:
                self.stop("user_stop")
            return USER, text
        self._attempted.append(action)
        answer = run_tool(self.db, self.session, action.tool, action.kwargs)
        if not answer.startswith("error:"):
            self._executed.append(action)
        return TOOL, answer

    def copy(self) -> RetailEnv:
        """An independent copy of the episode as it stands: same database, tool session, user state and conversation;
        what either does next never reaches the other. Tree rollouts branch an episode at a turn boundary with it
        (`play_episodes(..., branching=...)`; the protocol: `trl_dta.envs.core.rollout.CopyableEnv`)."""
        twin = copy.copy(self)
        twin.db = self.db.copy()
        twin.session = copy.deepcopy(self.session)
        twin.user = copy.copy(self.user)
        twin.messages, twin._turns = list(self.messages), list(self._turns)
        twin._said, twin._executed, twin._attempted = list(self._said), list(self._executed), list(self._attempted)
        return twin

    def stop(self, reason: str) -> None:
        """Ends the episode (the rollout calls it with `"max_tokens"`)."""
        if reason not in END_REASONS:
            raise ValueError(f"`reason` must be one of {END_REASONS}, got {reason!r}.")
        self.done, self.end_reason = True, reason

    @cached_property
    def _gold(self) -> Database:
        return self.domain.gold_database(self.task.task_id)

    def reward(self) -> RewardBreakdown:
        """The episode's reward so far (see `envs.retail.reward`); final once `done`."""
        return compute_reward(self.db, self._gold, self.task.required_info, self.task.gold_actions, self._turns,
                              self._said, self._executed, self._attempted)

r"""The episode reward: tau2-bench's success criterion, plus a shaped partial credit below it.

tau2-bench scores an episode 1 when the final database equals the database produced by replaying the task's gold
actions *and* the agent communicated the required information, else 0. A randomly initialised model essentially
never succeeds, so GRPO would see groups of equal rewards and no gradient. Below success, this reward therefore gives
a shaped partial credit that rises with every step toward it:

$$
\text{reward} = \begin{cases}
1 & \text{if db\_match and info} = 1 \quad \text{(tau2 success)}\\
0.5 \cdot (0.2 \cdot \text{protocol} + 0.5 \cdot \text{actions} + 0.3 \cdot \text{info}) & \text{otherwise}
\end{cases}
$$

- `protocol`: mean over the agent's turns of `protocol.protocol_score` (the keyword's first right characters count,
  then a known tool, then the right argument names; `1` for every well-formed turn);
- `actions`: fraction of the gold actions the agent executed without error (matched as a multiset: the same tool with
  the same arguments, in any order; each executed call matches at most one gold action);
- `info`: fraction of the required information said as a whole word in some `say` message.

Partial credit is at most `0.5` (reached only by a perfect-looking episode that broke the database), so any
success outranks any failure; a failure that breaks the database (say by
cancelling the wrong order) keeps its partial credit but can never succeed.

Shaped rewards (the recipe's default, as TRL's several `reward_funcs`, `envs.core.trl.SHAPED_REWARDS`) split the
same path to success into signals a random tiny model meets early, each in `[0, 1]` and logged on its own:

- `call_format`: well-formed tool calls, the mean over turns of `protocol.call_format_score` (a `say` turn 0.25, a
  call 0.5 to 1.0 as its tool and parameter names are right, partial credit for starting with `call `);
- `tools`: per gold action, the best share of its tool name that one of the agent's calls starts with (`find-u` for
  `find-user` earns 6/9), averaged over the gold actions: `envs.core.credits.tool_credit`; a call whose arguments do not
  parse still names its tool (`protocol.named_tool`: `call get-order order=o2, thanks` calls `get-order` with no
  arguments);
- `arguments`: the share of the gold calls' `key=value` pairs that some call of the same tool passed (attempted
  calls count, successful or not): `envs.core.credits.argument_credit`;
- on a task without gold calls (solved by talking: 2 of tau2 mock's 9 tasks) both are 1 when the agent called nothing
  and 0 when it called anything: there, any call is a mistake, and no call earns credit it did not make;
- `success`: tau2's outcome, 0 or 1.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.credits import argument_credit, tool_credit
from .database import Database
from .protocol import Call, call_format_score, protocol_score

PARTIAL_SCALE = 0.5
PROTOCOL_WEIGHT, ACTIONS_WEIGHT, INFO_WEIGHT = 0.2, 0.5, 0.3


@dataclass(frozen=True)
class RewardBreakdown:
    """The reward of one episode and its parts.

    Args:
        reward (`float`): `1.0` on success, else the partial credit, in `[0, 0.5]`.
        success (`bool`): tau2's criterion: `db_match and info == 1`.
        db_match (`bool`): final database == gold database.
        info (`float`): fraction of required information said.
        actions (`float`): fraction of gold actions executed without error.
        protocol (`float`): mean protocol score of the agent's turns (`0` without turns).
        tools (`float`): [`tool_credit`] of the agent's calls.
        arguments (`float`): [`argument_credit`] of the agent's calls.
        call_format (`float`): the mean `protocol.call_format_score` of the agent's turns (`0` without turns).
    """

    reward: float
    success: bool
    db_match: bool
    info: float
    actions: float
    protocol: float
    tools: float = 0.0
    arguments: float = 0.0
    call_format: float = 0.0


def info_said(required: Sequence[str], messages: Sequence[str]) -> float:
    """Fraction of `required` words that occur as whole words in some of `messages`."""
    if not required:
        return 1.0
    said = sum(any(re.search(rf"(?<!\w){re.escape(word)}(?!\w)", m) for m in messages) for word in required)
    return said / len(required)


def actions_done(gold: Sequence[Call], executed: Sequence[Call]) -> float:
    """Fraction of `gold` calls matched by `executed` calls (successful ones), as a multiset."""
    if not gold:
        return 1.0
    return sum((Counter(gold) & Counter(executed)).values()) / len(gold)


def compute_reward(
    final_db: Database,
    gold_db: Database,
    required_info: Sequence[str],
    gold_actions: Sequence[Call],
    turns: Sequence[str],
    said: Sequence[str],
    executed: Sequence[Call],
    attempted: Sequence[Call] = (),
) -> RewardBreakdown:
    """Scores one finished episode.

    Args:
        final_db ([`~envs.retail.database.Database`]): the database at the end of the episode.
        gold_db ([`~envs.retail.database.Database`]): the database after the gold actions.
        required_info (`Sequence[str]`): words the agent must say.
        gold_actions (`Sequence[Call]`): the task's gold calls.
        turns (`Sequence[str]`): every agent turn as decoded.
        said (`Sequence[str]`): the agent's `say` messages.
        executed (`Sequence[Call]`): the agent's tool calls that returned without error.
        attempted (`Sequence[Call]`, *optional*): every tool call the agent made, for the shaped credits (a call
            whose arguments did not parse with its tool and no arguments).

    Returns:
        [`RewardBreakdown`].
    """
    db_match = final_db == gold_db
    info = info_said(required_info, said)
    actions = actions_done(gold_actions, executed)
    protocol = sum(map(protocol_score, turns)) / len(turns) if turns else 0.0
    success = db_match and info == 1.0
    partial = PARTIAL_SCALE * (PROTOCOL_WEIGHT * protocol + ACTIONS_WEIGHT * actions + INFO_WEIGHT * info)
    gold = [(c.tool, c.kwargs) for c in gold_actions]
    called = [(c.tool, c.kwargs) for c in attempted]
    call_format = sum(map(call_format_score, turns)) / len(turns) if turns else 0.0
    return RewardBreakdown(1.0 if success else partial, success, db_match, info, actions, protocol,
                           tool_credit(gold, called), argument_credit(gold, called), call_format)

"""The retail tools as a TRL `environment_factory` environment, for hub models with tool-calling chat templates.

TRL 1.16's `GRPOTrainer(environment_factory=...)` makes one instance per rollout, calls `reset(**row)` with the
dataset row, exposes every public method (other than `reset` and `get_reward`) as a tool through the model's chat
template, runs the model's tool calls against them, and adds `get_reward()` as a reward source:

```python
from functools import partial
trainer = GRPOTrainer(model="Qwen/Qwen3-0.6B", environment_factory=partial(RetailToolEnv, domain),
                      train_dataset=build_dataset(domain, 64, conversational=True), ...)
```

TRL's tool loop has tool turns but no user turns, so the simulated user never speaks there: the model gets the
system prompt and the user's opening, and `get_reward` scores the database only (1.0 when it equals the gold
database). Whether the required information was said is in the completion text, which the environment does not see;
a reward function can check it with `envs.retail.reward.info_said`. This path needs a model with a tool-calling chat
template, hence the hub: it is not exercised by the offline tests (they check that TRL would find exactly the six
tools and that transformers can build their JSON schemas). The offline path is the text protocol with
`AgentRolloutFunc`.
"""

from __future__ import annotations

from .database import run_tool
from .env import RetailDomain, RetailEnv


class RetailToolEnv:
    """One rollout's retail episode behind TRL's environment interface.

    Args:
        domain ([`~envs.retail.env.RetailDomain`], *optional*): the domain; defaults to `RetailDomain()`.
    """

    def __init__(self, domain: RetailDomain | None = None):
        self._domain = domain if domain is not None else RetailDomain()
        self._env: RetailEnv | None = None

    def reset(self, task_id: int, **row) -> None:
        """Starts the episode of task `task_id` (a dataset column); other columns of the row are ignored."""
        self._env = self._domain.episode(task_id)

    def _call(self, tool: str, **args: str) -> str:
        if self._env is None:
            raise RuntimeError("call reset(task_id=...) before using the tools.")
        return run_tool(self._env.db, self._env.session, tool, args)

    def get_reward(self) -> float:
        """1.0 if the database equals the task's gold database, else 0.0."""
        if self._env is None:
            raise RuntimeError("call reset(task_id=...) before get_reward().")
        return float(self._env.db == self._domain.gold_database(self._env.task.task_id))

    def find_user(self, first: str, last: str, zip: str) -> str:
        """Find the id of a user from their name and zip code; the user counts as identified afterwards.

        Args:
            first: First name, lowercase.
            last: Last name, lowercase.
            zip: Five-digit zip code.
        """
        return self._call("find-user", first=first, last=last, zip=zip)

    def get_user(self, user: str) -> str:
        """Name, zip code and order ids of an identified user.

        Args:
            user: User id, such as u3.
        """
        return self._call("get-user", user=user)

    def get_order(self, order: str) -> str:
        """Status, city, items, total and returned items of an order of an identified user.

        Args:
            order: Order id, such as o7.
        """
        return self._call("get-order", order=order)

    def cancel_order(self, order: str, reason: str) -> str:
        """Cancel a pending order and refund its total.

        Args:
            order: Order id, such as o7.
            reason: Either mistake or unneeded.
        """
        return self._call("cancel-order", order=order, reason=reason)

    def return_item(self, order: str, item: str) -> str:
        """Return one item of a delivered order and refund its price.

        Args:
            order: Order id, such as o7.
            item: Item name, such as lamp.
        """
        return self._call("return-item", order=order, item=item)

    def change_city(self, order: str, city: str) -> str:
        """Ship a pending order to another city, for a fee.

        Args:
            order: Order id, such as o7.
            city: The new city.
        """
        return self._call("change-city", order=order, city=city)

"""Procedurally generated tasks: a scenario for the user simulator, the gold actions and the information to convey.

A tau2-bench task gives the user simulator a scenario (the reason for the call, what the user knows, the goal) and
the grader the gold actions and the information the agent must communicate. Here a task is drawn from the domain's
database by `(seed, task_id)`:

| kind          | the user wants                         | gold actions (after find-user)    | agent must say  |
|---------------|----------------------------------------|-----------------------------------|-----------------|
| `cancel`      | a pending order cancelled, with reason | get-order, cancel-order           | the refund      |
| `return`      | an item of a delivered order returned  | get-user, get-order, return-item  | the refund      |
| `change-city` | a pending order shipped elsewhere      | get-order, change-city            | the fee         |
| `status`      | the status and total of an order       | get-order                         | status, total   |

The user of a `return` task knows the item but not the order id (the agent has to look through the user's orders);
the others know their order id. The opening line states the reason and, drawn per task, some of the facts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .database import (
    CANCEL_REASONS,
    CITIES,
    DELIVERED,
    PENDING,
    Database,
    Order,
    Session,
    User,
    run_tool,
    shipping_fee,
)
from .protocol import Call

KINDS = ("cancel", "return", "change-city", "status")

_GOALS = {
    "cancel": "i want to cancel an order.",
    "return": "i want to return my {item}.",
    "change-city": "i want my order shipped to another city.",
    "status": "what is the status and total of my order?",
}


@dataclass(frozen=True)
class Task:
    """One scenario and its grading.

    Args:
        task_id (`int`): index of the task in its domain; the ticket number of the prompt.
        kind (`str`): one of `KINDS`.
        user_id (`str`), first (`str`), last (`str`), zip (`str`): who calls (the user knows name and zip).
        order_id (`str`): the order the call is about.
        knows_order_id (`bool`): whether the user can tell the order id.
        item (`str` or `None`): the item to return (`return` tasks).
        reason (`str` or `None`): `mistake` or `unneeded` (`cancel` tasks).
        city (`str` or `None`): the new city (`change-city` tasks).
        goal (`str`): the user's request in one sentence; also what the user repeats when not helped.
        opening (`str`): the user's first message: the goal and the facts volunteered up front.
        gold_actions (`tuple[Call, ...]`): the calls that solve the task, in order.
        required_info (`tuple[str, ...]`): words the agent must say (each as a whole word in some `say` message).
    """

    task_id: int
    kind: str
    user_id: str
    first: str
    last: str
    zip: str
    order_id: str
    knows_order_id: bool
    item: str | None
    reason: str | None
    city: str | None
    goal: str
    opening: str
    gold_actions: tuple[Call, ...]
    required_info: tuple[str, ...]


def _candidates(db: Database, kind: str) -> list[str]:
    wanted = {"cancel": PENDING, "change-city": PENDING, "return": DELIVERED}.get(kind)
    return [
        order_id for order_id, order in db.orders.items()
        if wanted is None or (order.status == wanted and (kind != "return" or len(order.returned) < len(order.items)))
    ]


def _cancel(rng: random.Random, order: Order, user: User) -> tuple[dict, tuple[Call, ...], tuple[str, ...]]:
    reason = rng.choice(CANCEL_REASONS)
    actions = (Call.of("get-order", order=order.order_id),
               Call.of("cancel-order", order=order.order_id, reason=reason))
    return {"reason": reason}, actions, (str(order.total),)


def _return(rng: random.Random, order: Order, user: User) -> tuple[dict, tuple[Call, ...], tuple[str, ...]]:
    item = rng.choice([name for name in order.items if name not in order.returned])
    actions = (Call.of("get-user", user=user.user_id), Call.of("get-order", order=order.order_id),
               Call.of("return-item", order=order.order_id, item=item))
    return {"item": item}, actions, (str(order.items[item]),)


def _change_city(rng: random.Random, order: Order, user: User) -> tuple[dict, tuple[Call, ...], tuple[str, ...]]:
    city = rng.choice([c for c in CITIES if c != order.city])
    actions = (Call.of("get-order", order=order.order_id), Call.of("change-city", order=order.order_id, city=city))
    return {"city": city}, actions, (str(shipping_fee(order.order_id, city)),)


def _status(rng: random.Random, order: Order, user: User) -> tuple[dict, tuple[Call, ...], tuple[str, ...]]:
    return {}, (Call.of("get-order", order=order.order_id),), (order.status, str(order.total))


# kind -> (rng, order, user) -> (the scenario's details, gold actions after find-user, required information).
_PLANS = {"cancel": _cancel, "return": _return, "change-city": _change_city, "status": _status}


def generate_task(db: Database, task_id: int, seed: int) -> Task:
    """Draws task `task_id` of the domain with database `db` and seed `seed` (the same arguments give the same task).

    Args:
        db ([`~envs.retail.database.Database`]): the domain's initial database (not changed).
        task_id (`int`): the task's index, `>= 0`.
        seed (`int`): the domain's seed.

    Returns:
        [`Task`].
    """
    rng = random.Random(seed * 1_000_003 + task_id)
    kind = rng.choice(KINDS)
    order = db.orders[rng.choice(_candidates(db, kind))]
    user = db.users[order.user_id]
    details, actions, info = _PLANS[kind](rng, order, user)
    find = Call.of("find-user", first=user.first, last=user.last, zip=user.zip)
    knows_order_id = kind != "return"
    goal = _GOALS[kind].format(item=details.get("item"))
    facts = []
    if rng.random() < 0.5:
        facts.append(f"i am {user.first} {user.last}.")
        if rng.random() < 0.5:
            facts.append(f"my zip is {user.zip}.")
    if knows_order_id and rng.random() < 0.5:
        facts.append(f"the order is {order.order_id}.")
    return Task(task_id, kind, user.user_id, user.first, user.last, user.zip, order.order_id, knows_order_id,
                details.get("item"), details.get("reason"), details.get("city"), goal, " ".join(["hi,", goal, *facts]),
                (find, *actions), info)


def gold_database(db: Database, task: Task) -> Database:
    """The database after replaying the task's gold actions on a copy of `db` (the reward's target)."""
    gold, session = db.copy(), Session()
    for action in task.gold_actions:
        answer = run_tool(gold, session, action.tool, action.kwargs)
        if answer.startswith("error:"):
            raise RuntimeError(f"gold action {action.render()} of task {task.task_id} failed: {answer}")
    return gold

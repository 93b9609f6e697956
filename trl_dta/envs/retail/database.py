r"""The retail domain's in-memory database and the tools that read and change it.

A shop with users and their orders, in the spirit of tau2-bench's retail domain, small enough to generate in code:

```
users:   u1  ann lee,  zip 40213, orders o1 o2
         u2  bob kim,  zip 77120, orders o3
orders:  o1  user u1, pending,   ships to paris, items lamp 25 mug 8
         o2  user u1, delivered, ships to rome,  items desk 90 (returned: none)
```

Six tools act on it. Each takes string arguments, returns one line of text and either changes the database or not:

| tool           | arguments          | changes                       | refuses when                             |
|----------------|--------------------|-------------------------------|------------------------------------------|
| `find-user`    | first, last, zip   | marks the user as identified  | no such user                             |
| `get-user`     | user               | -                             | user not identified                      |
| `get-order`    | order              | -                             | order's user not identified              |
| `cancel-order` | order, reason      | status -> cancelled, reason   | not pending, reason not mistake/unneeded |
| `return-item`  | order, item        | item added to `returned`      | not delivered, item unknown or returned  |
| `change-city`  | order, city        | `city` -> the new city        | not pending, city not served             |

A refusal is a [`ToolError`] whose message the environment sends back to the agent as the tool's answer; a tool never
crashes the episode. "Identified" is per episode ([`Session`]): the policy document tells the agent to find the user
before anything else, and the tools enforce it. Every string the tools produce is lowercase ASCII over the alphabet of
the tiny tokenizer (`trl_dta.demos.tiny.ALPHABET`), so the offline model can read and write all of it.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field

FIRST_NAMES = ("ann", "bob", "carla", "dan", "eva", "farid", "gina", "hugo", "ines", "jon", "kira", "leo", "mia",
               "noah", "olga", "pablo")
LAST_NAMES = ("lee", "kim", "diaz", "silva", "novak", "khan", "rossi", "berg", "sato", "okafor", "smith", "garcia")
CITIES = ("paris", "rome", "lima", "oslo", "cairo", "delhi", "tokyo", "quito", "dakar", "perth", "austin", "boston")
ITEMS = ("lamp", "mug", "chair", "desk", "kettle", "pillow", "clock", "towel", "vase", "rug", "fan", "shelf",
         "blender", "toaster", "mirror")
CANCEL_REASONS = ("mistake", "unneeded")
PENDING, DELIVERED, CANCELLED = "pending", "delivered", "cancelled"


@dataclass
class User:
    """A customer.

    Args:
        user_id (`str`): `"u<n>"`.
        first (`str`), last (`str`): the name, one lowercase word each.
        zip (`str`): five digits.
        orders (`list[str]`): the user's order ids.
    """

    user_id: str
    first: str
    last: str
    zip: str
    orders: list[str] = field(default_factory=list)


@dataclass
class Order:
    """An order.

    Args:
        order_id (`str`): `"o<n>"`.
        user_id (`str`): the customer.
        status (`str`): `"pending"`, `"delivered"` or `"cancelled"`.
        city (`str`): where it ships.
        items (`dict[str, int]`): item name -> price, distinct names.
        returned (`list[str]`): items returned so far, in the order they were returned.
        cancel_reason (`str` or `None`): why the order was cancelled (`mistake` or `unneeded`), if it was.
    """

    order_id: str
    user_id: str
    status: str
    city: str
    items: dict[str, int]
    returned: list[str] = field(default_factory=list)
    cancel_reason: str | None = None

    @property
    def total(self) -> int:
        return sum(self.items.values())


@dataclass
class Database:
    """Users and orders. Two databases are equal when every user and every order is (dataclass equality).

    Args:
        users (`dict[str, User]`): by user id.
        orders (`dict[str, Order]`): by order id.
    """

    users: dict[str, User]
    orders: dict[str, Order]

    def copy(self) -> Database:
        """A deep copy: tools change the copy, never the domain's initial database."""
        return copy.deepcopy(self)


def generate_database(seed: int, num_users: int) -> Database:
    """Draws a database: `num_users` users with distinct (first, last, zip), each with 1-3 orders of 1-3 items.

    Every user has at least one pending and, from the second order on, at least one delivered order, so that every
    task kind finds an order to act on. The draw depends only on `seed` and `num_users`.
    """
    rng = random.Random(seed)
    users, orders, seen = {}, {}, set()
    for u in range(1, num_users + 1):
        while True:
            first, last, zip_code = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES), f"{rng.randrange(10**5):05d}"
            if (first, last, zip_code) not in seen:
                seen.add((first, last, zip_code))
                break
        user = User(f"u{u}", first, last, zip_code)
        for k in range(rng.randint(1, 3)):
            order_id = f"o{len(orders) + 1}"
            status = (PENDING, DELIVERED)[k % 2] if k < 2 else rng.choice((PENDING, DELIVERED))
            items = {name: rng.randint(5, 120) for name in rng.sample(ITEMS, rng.randint(1, 3))}
            orders[order_id] = Order(order_id, user.user_id, status, rng.choice(CITIES), items)
            user.orders.append(order_id)
        users[user.user_id] = user
    return Database(users, orders)


def shipping_fee(order_id: str, city: str) -> int:
    """The fee `change-city` charges: a fixed function of the order and the city (3 to 19)."""
    return 3 + (sum(map(ord, city)) + int(order_id[1:])) % 17


class ToolError(Exception):
    """A refused tool call; its message (starting with `error:`) is the tool's answer to the agent."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


@dataclass
class Session:
    """Per-episode tool state: which users the agent has identified with `find-user`."""

    identified: set[str] = field(default_factory=set)


def _order(db: Database, session: Session, order_id: str) -> Order:
    order = db.orders.get(order_id)
    if order is None:
        raise ToolError(f"no order {order_id}.")
    if order.user_id not in session.identified:
        raise ToolError("find the user with find-user first.")
    return order


def find_user(db: Database, session: Session, first: str, last: str, zip: str) -> str:
    for user in db.users.values():
        if (user.first, user.last, user.zip) == (first, last, zip):
            session.identified.add(user.user_id)
            return f"user {user.user_id}"
    raise ToolError("no user with that name and zip.")


def get_user(db: Database, session: Session, user: str) -> str:
    record = db.users.get(user)
    if record is None:
        raise ToolError(f"no user {user}.")
    if user not in session.identified:
        raise ToolError("find the user with find-user first.")
    return f"user {user}: {record.first} {record.last}, zip {record.zip}, orders {' '.join(record.orders)}"


def get_order(db: Database, session: Session, order: str) -> str:
    record = _order(db, session, order)
    items = " ".join(f"{name} {price}" for name, price in record.items.items())
    returned = " ".join(record.returned) or "none"
    return (f"order {order}: {record.status}, ships to {record.city}, items {items}, total {record.total}, "
            f"returned {returned}")


def cancel_order(db: Database, session: Session, order: str, reason: str) -> str:
    record = _order(db, session, order)
    if record.status != PENDING:
        raise ToolError(f"order {order} is {record.status}, only pending orders can be cancelled.")
    if reason not in CANCEL_REASONS:
        raise ToolError(f"reason must be {' or '.join(CANCEL_REASONS)}.")
    record.status, record.cancel_reason = CANCELLED, reason
    return f"order {order} cancelled, refund {record.total}"


def return_item(db: Database, session: Session, order: str, item: str) -> str:
    record = _order(db, session, order)
    if record.status != DELIVERED:
        raise ToolError(f"order {order} is {record.status}, only delivered orders take returns.")
    if item not in record.items:
        raise ToolError(f"order {order} has no {item}.")
    if item in record.returned:
        raise ToolError(f"the {item} of order {order} was already returned.")
    record.returned.append(item)
    return f"{item} of order {order} returned, refund {record.items[item]}"


def change_city(db: Database, session: Session, order: str, city: str) -> str:
    record = _order(db, session, order)
    if record.status != PENDING:
        raise ToolError(f"order {order} is {record.status}, only pending orders can change city.")
    if city not in CITIES:
        raise ToolError(f"we do not ship to {city}.")
    record.city = city
    return f"order {order} now ships to {city}, fee {shipping_fee(order, city)}"


@dataclass(frozen=True)
class ToolSpec:
    """One tool: its protocol name, its parameters (all strings, all required), what it does, its implementation.

    Args:
        name (`str`): the name the agent calls, e.g. `"get-order"`.
        params (`tuple[str, ...]`): parameter names, in the order the policy document lists them.
        description (`str`): one line for the policy document.
        run (`Callable[..., str]`): `run(db, session, **args) -> str`; raises [`ToolError`] to refuse.
        writes (`bool`): whether the tool can change the database.
    """

    name: str
    params: tuple[str, ...]
    description: str
    run: Callable[..., str]
    writes: bool


TOOLS: dict[str, ToolSpec] = {
    spec.name: spec
    for spec in (
        ToolSpec("find-user", ("first", "last", "zip"), "user id", find_user, False),
        ToolSpec("get-user", ("user",), "name, zip, orders", get_user, False),
        ToolSpec("get-order", ("order",), "status, city, items, total", get_order, False),
        ToolSpec("cancel-order", ("order", "reason"), "pending order, reason mistake or unneeded", cancel_order, True),
        ToolSpec("return-item", ("order", "item"), "item of a delivered order", return_item, True),
        ToolSpec("change-city", ("order", "city"), "pending order ships to a new city", change_city, True),
    )
}


def run_tool(db: Database, session: Session, name: str, args: dict[str, str]) -> str:
    """Runs one tool call and returns its answer; a refusal or a bad call comes back as an `error: ...` line.

    Args:
        db ([`Database`]): the episode's database (changed in place by write tools).
        session ([`Session`]): the episode's tool state.
        name (`str`): tool name as the agent spelled it.
        args (`dict[str, str]`): argument name -> value.

    Returns:
        `str`: the tool's answer, or `error: ...` for an unknown tool, missing or unexpected arguments, or a refusal.
    """
    spec = TOOLS.get(name)
    if spec is None:
        return f"error: unknown tool {name}. tools: {', '.join(TOOLS)}."
    missing = [p for p in spec.params if p not in args]
    unexpected = [a for a in args if a not in spec.params]
    if missing or unexpected:
        problems = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unexpected {', '.join(unexpected)}"] if unexpected else [])
        return f"error: {name} takes {' '.join(spec.params)}; {'; '.join(problems)}."
    try:
        return spec.run(db, session, **args)
    except ToolError as error:
        return str(error)

"""The retail database and its tools: generation, every refusal, every change."""

from __future__ import annotations

import pytest

from trl_dta.demos.tiny import ALPHABET
from trl_dta.envs.retail.database import (
    CANCELLED,
    DELIVERED,
    PENDING,
    TOOLS,
    Session,
    generate_database,
    run_tool,
    shipping_fee,
)


@pytest.fixture
def db():
    return generate_database(seed=0, num_users=16)


def _user_with(db, *statuses):
    for user in db.users.values():
        if {db.orders[o].status for o in user.orders} >= set(statuses):
            return user
    raise AssertionError(f"no user with orders {statuses}")


def _identified(db, user):
    session = Session()
    assert run_tool(db, session, "find-user", {"first": user.first, "last": user.last, "zip": user.zip}) == \
        f"user {user.user_id}"
    return session


def test_generation_is_deterministic(db):
    assert generate_database(0, 16) == db
    assert generate_database(1, 16) != db
    keys = [(u.first, u.last, u.zip) for u in db.users.values()]
    assert len(set(keys)) == len(keys)
    for user in db.users.values():
        statuses = [db.orders[o].status for o in user.orders]
        assert statuses[0] == PENDING and (len(statuses) < 2 or statuses[1] == DELIVERED)
        assert all(db.orders[o].user_id == user.user_id for o in user.orders)


def test_copy_is_deep(db):
    copy = db.copy()
    next(iter(copy.orders.values())).returned.append("lamp")
    assert copy != db


@pytest.mark.parametrize(
    "name,args,message",
    [
        ("fly", {}, "error: unknown tool fly. tools: find-user, get-user, get-order, cancel-order, return-item, "
                    "change-city."),
        ("get-order", {}, "error: get-order takes order; missing order."),
        ("get-order", {"order": "o1", "user": "u1"}, "error: get-order takes order; unexpected user."),
        ("cancel-order", {"item": "x"}, "error: cancel-order takes order reason; missing order, reason; "
                                        "unexpected item."),
        ("find-user", {"first": "no", "last": "body", "zip": "00000"}, "error: no user with that name and zip."),
        ("get-user", {"user": "u99"}, "error: no user u99."),
        ("get-user", {"user": "u1"}, "error: find the user with find-user first."),
        ("get-order", {"order": "o1"}, "error: find the user with find-user first."),
        ("get-order", {"order": "o999"}, "error: no order o999."),
    ],
)
def test_bad_calls_are_answered_not_raised(db, name, args, message):
    before = db.copy()
    assert run_tool(db, Session(), name, args) == message
    assert db == before


def test_refusals_after_identification(db):
    user = _user_with(db, PENDING, DELIVERED)
    session = _identified(db, user)
    pending = next(o for o in user.orders if db.orders[o].status == PENDING)
    delivered = next(o for o in user.orders if db.orders[o].status == DELIVERED)
    other = next(o for o, order in db.orders.items() if order.user_id != user.user_id)
    item = next(iter(db.orders[delivered].items))
    before = db.copy()
    for name, args, message in [
        ("get-order", {"order": other}, "error: find the user with find-user first."),
        ("cancel-order", {"order": delivered, "reason": "mistake"},
         f"error: order {delivered} is delivered, only pending orders can be cancelled."),
        ("cancel-order", {"order": pending, "reason": "bored"}, "error: reason must be mistake or unneeded."),
        ("return-item", {"order": pending, "item": item},
         f"error: order {pending} is pending, only delivered orders take returns."),
        ("return-item", {"order": delivered, "item": "spaceship"}, f"error: order {delivered} has no spaceship."),
        ("change-city", {"order": delivered, "city": "rome"},
         f"error: order {delivered} is delivered, only pending orders can change city."),
        ("change-city", {"order": pending, "city": "atlantis"}, "error: we do not ship to atlantis."),
    ]:
        assert run_tool(db, session, name, args) == message
    assert db == before


def test_writes(db):
    user = _user_with(db, PENDING, DELIVERED)
    session = _identified(db, user)
    pending = next(o for o in user.orders if db.orders[o].status == PENDING)
    delivered = next(o for o in user.orders if db.orders[o].status == DELIVERED)
    item, price = next(iter(db.orders[delivered].items.items()))
    city = next(c for c in ("rome", "oslo") if c != db.orders[pending].city)
    assert run_tool(db, session, "change-city", {"order": pending, "city": city}) == \
        f"order {pending} now ships to {city}, fee {shipping_fee(pending, city)}"
    assert db.orders[pending].city == city
    assert run_tool(db, session, "return-item", {"order": delivered, "item": item}) == \
        f"{item} of order {delivered} returned, refund {price}"
    assert db.orders[delivered].returned == [item]
    assert run_tool(db, session, "return-item", {"order": delivered, "item": item}) == \
        f"error: the {item} of order {delivered} was already returned."
    total = db.orders[pending].total
    assert run_tool(db, session, "cancel-order", {"order": pending, "reason": "unneeded"}) == \
        f"order {pending} cancelled, refund {total}"
    assert (db.orders[pending].status, db.orders[pending].cancel_reason) == (CANCELLED, "unneeded")
    answer = run_tool(db, session, "get-order", {"order": delivered})
    assert answer.startswith(f"order {delivered}: delivered, ships to ") and answer.endswith(f"returned {item}")
    assert run_tool(db, session, "get-user", {"user": user.user_id}).endswith(f"orders {' '.join(user.orders)}")


def test_tool_text_is_in_the_tiny_alphabet(db):
    alphabet = set(ALPHABET)
    for user in db.users.values():
        session = _identified(db, user)
        texts = [run_tool(db, session, "get-user", {"user": user.user_id})]
        texts += [run_tool(db, session, "get-order", {"order": o}) for o in user.orders]
        assert set("".join(texts)) <= alphabet
    for spec in TOOLS.values():
        assert set(spec.name + spec.description + "".join(spec.params)) <= alphabet

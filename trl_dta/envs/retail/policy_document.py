"""The policy document: the agent's system prompt, identical for every task of a domain.

In tau2-bench the agent's system prompt holds the whole domain policy (several thousand tokens) and the tool schemas,
and it is the same for every task of the domain: the longest prefix every rollout of a training step shares. Here it
has three parts:

```
you are a shop agent. one action per turn:           <- the turn protocol (protocol.py)
say message
call tool key=value ...
tools:                                               <- one line per tool (database.TOOLS)
find-user first last zip: user id
...
policy:                                              <- the rules the tools enforce or the reward checks
1. find the user with find-user first.
...
4. gift cards are not refunded after 30 days.        <- filler clauses, up to `min_chars`
```

The filler clauses make the document as long as a benchmark needs (`min_chars` characters, about `min_chars` tokens
with the tiny character tokenizer and about `min_chars / 4` with a BPE tokenizer). They are drawn from fixed word
lists with a seeded generator, so a domain's document is reproducible, and they never contradict the core rules (they
speak of things the tools do not handle).
"""

from __future__ import annotations

import random

from .database import TOOLS

_HEADER = "you are a shop agent. one action per turn:\nsay message\ncall tool key=value ...\ntools:\n"
_RULES = ("find the user with find-user first.", "only act on orders of that user.", "tell the user the refund or fee.")

_SUBJECTS = ("gift cards", "store credits", "bulk orders", "sale items", "gift wraps", "express deliveries",
             "price matches", "loyalty points", "extended warranties", "digital coupons", "pickup orders",
             "custom engravings")
_VERBS = ("are not refunded", "can not be combined", "are handled by the billing team", "need a manager",
          "are limited to two per user", "are checked by hand", "can not be moved", "are not discussed by phone")
_CONDITIONS = ("after {n} days", "within {n} days of delivery", "for orders above {m}", "on public holidays",
               "once the item ships", "without a receipt", "for users outside the country", "in any case")


def _filler_clause(rng: random.Random) -> str:
    condition = rng.choice(_CONDITIONS).format(n=rng.randint(2, 90), m=rng.randint(50, 900))
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {condition}."


def policy_document(min_chars: int = 0, seed: int = 0) -> str:
    """The system prompt of the retail domain.

    Args:
        min_chars (`int`, *optional*, defaults to `0`):
            Smallest length of the document in characters: numbered filler clauses are appended until it is reached.
            `0` keeps the core document (about 500 characters).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the filler clauses.

    Returns:
        `str`: the document, ending with a newline; the same for equal arguments.
    """
    tools = "".join(f"{spec.name} {' '.join(spec.params)}: {spec.description}\n" for spec in TOOLS.values())
    rules = [f"{i}. {rule}\n" for i, rule in enumerate(_RULES, start=1)]
    text = _HEADER + tools + "policy:\n" + "".join(rules)
    rng, number = random.Random(seed), len(rules)
    while len(text) < min_chars:
        number += 1
        text += f"{number}. {_filler_clause(rng)}\n"
    return text

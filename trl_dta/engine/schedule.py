"""The schedule: how the children of a segment run, decided before any of them runs.

Under the current path the walk reaches a segment's children (the roots, for the empty path). Each child is either

- run as a **row** of a batched forward: a leaf (a segment without children), or a whole subtree of at most
  `max_pack_tokens` tokens packed into one row with a tree mask (see `rows.py`). Rows are sorted by size and grouped so
  that a batch's padded size (rows x longest row) fits `max_batch_tokens` and, in training, the graph budget;
- run **alone in blocks** (recompute mode): a leaf too large for the graph budget even as a batch of one;
- **walked** segment by segment (push, its own children, pop): a subtree too large to pack, or one that does not fit
  the graph budget as a row.

The decision depends only on the tree, the budgets and the graph tokens already kept on the path (`live`), which
running rows and lone leaves does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Budgets:
    """The engine's size knobs (see [`DTAEngine`] for their meaning)."""

    block_size: int
    max_batch_tokens: int
    max_graph_tokens: int | None
    max_pack_tokens: int
    lm_head_chunk_size: int


@dataclass
class ChildSchedule:
    """What to do with the children of one segment, in execution order.

    Args:
        steps (`list[tuple[str, list[int]]]`): `("rows", roots)`: one batched forward whose rows are the subtrees of
            `roots`; `("blocks", [leaf])`: one leaf run alone in recompute mode. In this order, before `walk`.
        walk (`list[int]`): children walked segment by segment, in this order (smallest subtree first).
    """

    steps: list[tuple[str, list[int]]] = field(default_factory=list)
    walk: list[int] = field(default_factory=list)


def block_bounds(length: int, block_size: int, min_block: int = 1) -> list[tuple[int, int]]:
    """`[lo, hi)` bounds of the recompute blocks of a segment of `length` tokens: `block_size` tokens each, the last
    one shorter. With `min_block > 1` (hybrid models, whose layers decode a single token in place) no block is shorter
    than `min_block` unless the whole segment is: a short last block joins the one before it (which then holds up to
    `block_size + min_block - 1` tokens).

    Example: `block_bounds(5, 2)` is `[(0, 2), (2, 4), (4, 5)]`; `block_bounds(5, 2, min_block=2)` is
    `[(0, 2), (2, 5)]`.
    """
    size = max(block_size, min_block)
    bounds = [(lo, min(lo + size, length)) for lo in range(0, length, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < min_block:
        (lo, _), (_, hi) = bounds[-2], bounds.pop()
        bounds[-1] = (lo, hi)
    return bounds


def graph_fits(budgets: Budgets, train: bool, live: int, n_tokens: int) -> bool:
    """Whether `n_tokens` more tokens of autograd graph fit beside the `live` ones kept on the path."""
    budget = budgets.max_graph_tokens
    return not train or budget is None or live + n_tokens <= budget


def schedule_children(children: list[int], has_children: list[bool], subtree_tokens: list[int], budgets: Budgets,
                      *, train: bool, live: int) -> ChildSchedule:
    """Plan the children of one segment (see the module docstring).

    Args:
        children (`list[int]`): the child segments (the tree's roots for the empty path).
        has_children (`list[bool]`): `(n_segments,)` whether each segment has children (is not a leaf).
        subtree_tokens (`list[int]`): `(n_segments,)` tree tokens of each segment's subtree.
        budgets (`Budgets`): the engine's knobs.
        train (`bool`): whether the graph budget applies (only autograd graphs count against it).
        live (`int`): graph tokens kept on the current path.
    """
    pack = min(budgets.max_pack_tokens, budgets.max_batch_tokens)
    rows = sorted((c for c in children if not has_children[c] or subtree_tokens[c] <= pack),
                  key=subtree_tokens.__getitem__)
    walk = [c for c in children if has_children[c] and subtree_tokens[c] > pack]
    out = ChildSchedule()
    for batch in row_batches(rows, subtree_tokens, budgets, train, live):
        c = batch[0]
        if len(batch) == 1 and not graph_fits(budgets, train, live, subtree_tokens[c]):
            if has_children[c]:
                walk.append(c)  # walk it segment by segment instead of packing it
            else:
                out.steps.append(("blocks", batch))
        else:
            out.steps.append(("rows", batch))
    out.walk = sorted(walk, key=subtree_tokens.__getitem__)
    return out


def row_batches(rows: list[int], subtree_tokens: list[int], budgets: Budgets, train: bool,
                live: int) -> list[list[int]]:
    """Group rows (sorted by size) so that each batch's padded size fits `max_batch_tokens` and the graph budget."""
    out, cur = [], []
    for c in rows:  # sorted: the padded size of a batch is its last row's size times its number of rows
        padded = (len(cur) + 1) * subtree_tokens[c]
        if cur and (padded > budgets.max_batch_tokens or not graph_fits(budgets, train, live, padded)):
            out.append(cur)
            cur = []
        cur.append(c)
    if cur:
        out.append(cur)
    return out

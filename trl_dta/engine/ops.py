"""The walk's order of operations, written once: a pure, tensor-free op stream.

[`walk_ops`] turns the tree, the budgets, the layout (hybrid or not) and an optional lockstep batch count into the
sequence of operations the engine's walk performs (`walk.py` executes it, `memory.py` replays it to find the peak):

- [`Rows`]: one batched forward of subtree rows (`rows.py`: chains as causal rows, branching subtrees and shared rows
  under a tree mask), their sequences visited, one backward;
- [`Push`]: forward a run (a segment and its single-child descendants) after the path, push its frames, visit the
  sequences that end in it. Kept (`blocks is None`): one forward, with grad in training. Recompute mode: no-grad
  forwards of its `blocks` (over the whole run);
- [`Pop`]: pop the run: inject its accumulated gradients into its kept graph, or (recompute mode, training)
  re-forward its blocks with grad, last to first;
- [`Idle`]: a lockstep batch without work (one padding token, no loss), so the layers' collectives match.

Every op lists its model forwards ([`Forward`]: rows, tokens per row as forwarded, the path under it, the graph
kept on the path, whether it records a graph), in execution order.

The order is the depth-first schedule of `schedule.py`: the children of a segment (the roots, for the empty path)
run as row batches first, then the others are walked one by one (push their run, schedule the run's last segment's
children, pop), smallest subtree first. In lockstep (`lockstep=n`, FSDP2's per-layer schedule) the whole tree runs as
batches of packed root subtrees ([`lockstep_batches`]), then `n` minus their number idle batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..tree import PrefixTree
from .schedule import (
    Budgets,
    TreeShape,
    batch_width,
    block_bounds,
    pack_decisions,
    row_layout,
    row_room,
    run_pieces,
    schedule_children,
)


@dataclass(frozen=True)
class Forward:
    """One model forward of the walk.

    Args:
        rows (`int`): batch size.
        length (`int`): tokens per row as forwarded, padding included (a hybrid's one-token forward after a path is
            padded to two, `walk.py`).
        path_tokens (`int`): keys/values on the stack under it.
        frames (`int`): frames on the stack under it.
        graph_tokens (`int`): tokens of the path whose autograd graph is kept (not counting this forward).
        grad (`bool`): whether it records an autograd graph.
    """

    rows: int
    length: int
    path_tokens: int
    frames: int
    graph_tokens: int
    grad: bool

    @property
    def row_tokens(self) -> int:
        """Padded tokens of the forward (`rows x length`)."""
        return self.rows * self.length


@dataclass(frozen=True)
class Rows:
    """One batched forward of subtree rows under the current path: each row holds the subtrees of its roots side by
    side (pre-order each, `rows.py`)."""

    rows: tuple[tuple[int, ...], ...]
    forwards: tuple[Forward, ...]


@dataclass(frozen=True)
class Push:
    """Forward a run of `segments` (consecutive in pre-order, each the only child of the one before) after the path
    and push it: kept (`blocks is None`: one forward, with grad in training) or in recompute `blocks` (`[lo, hi)`
    bounds within the run, each forwarded without grad)."""

    segments: tuple[int, ...]
    blocks: tuple[tuple[int, int], ...] | None
    forwards: tuple[Forward, ...]


@dataclass(frozen=True)
class Pop:
    """Pop the run `segments` (pushed with the same `blocks`); in training with `blocks`, its blocks are re-forwarded
    with grad, last to first (`forwards`)."""

    segments: tuple[int, ...]
    blocks: tuple[tuple[int, int], ...] | None
    forwards: tuple[Forward, ...]


@dataclass(frozen=True)
class Idle:
    """A lockstep batch without work: one padding token at position 0, no loss."""

    forwards: tuple[Forward, ...]


Op = Rows | Push | Pop | Idle


def lockstep_batches(tree: PrefixTree, budgets: Budgets, *, train: bool) -> list[tuple[tuple[int, ...], ...]]:
    """The row batches of the lockstep walk: the roots' subtrees as rows, laid out as any children's rows
    (`schedule.row_layout`: padded, one per forward, or side by side in shared rows, whichever the cost model
    prices lowest; a subtree larger than the budget is a batch of its own); the count the processes agree on is their
    largest."""
    shape = TreeShape.of(tree)
    room = row_room(budgets, train, 0)
    fits = [r for r in tree.roots if shape.subtree_tokens[r] <= room]
    alone = [((r,),) for r in tree.roots if shape.subtree_tokens[r] > room]
    return row_layout(fits, shape, budgets.cost, room=room, path=0, shared=budgets.tree_rows) + alone


def walk_ops(tree: PrefixTree, budgets: Budgets, *, train: bool, hybrid: bool = False,
             lockstep: int | None = None) -> Iterator[Op]:
    """The walk's operations in execution order (see the module docstring).

    Args:
        tree (`PrefixTree`): the tree the walk traverses (for a hybrid, already `unshared`, as the engine walks it).
        budgets (`Budgets`): the engine's knobs (for a hybrid, `max_pack_tokens=0`, as the engine sets it).
        train (`bool`): a training walk (the graph budget applies, forwards record graphs, recomputed blocks
            re-forward at pop).
        hybrid (`bool`, *optional*, defaults to `False`): recurrent layers in the model: no recompute block shorter
            than two tokens, one-token forwards after a path padded to two.
        lockstep (`int`, *optional*): run as [`lockstep_batches`] plus idle batches up to this count (the largest
            count of the processes); at least this tree's own count.
    """
    if lockstep is not None:
        yield from _lockstep_ops(tree, budgets, train, lockstep)
        return
    yield from _Schedule(tree, budgets, train, hybrid).ops()


def _lockstep_ops(tree: PrefixTree, budgets: Budgets, train: bool, n: int) -> Iterator[Op]:
    batches = lockstep_batches(tree, budgets, train=train)
    if n < len(batches):
        raise RuntimeError(f"lockstep: the processes agreed on {n} row batches, fewer than this one's "
                           f"{len(batches)}; `lockstep` must return the largest count.")
    shape = TreeShape.of(tree)
    for batch in batches:
        yield Rows(batch, (Forward(len(batch), batch_width(batch, shape), 0, 0, 0, train),))
    for _ in range(n - len(batches)):
        yield Idle((Forward(1, 1, 0, 0, 0, train),))


class _Schedule:
    """The depth-first walk's state (path tokens, frames, kept graph tokens) while it yields its ops."""

    def __init__(self, tree: PrefixTree, budgets: Budgets, train: bool, hybrid: bool):
        self.tree, self.budgets, self.train, self.hybrid = tree, budgets, train, hybrid
        self.shape = TreeShape.of(tree)
        self.pack = pack_decisions(self.shape, budgets)
        self.path = self.frames = self.live = 0
        self.pushed: dict[tuple[int, ...], Push] = {}

    def ops(self) -> Iterator[Op]:
        todo: list[tuple[str, object]] = [("children", -1)]  # from the empty path
        while todo:
            kind, item = todo.pop()
            if kind == "push":
                yield self._push(*item)
            elif kind == "pop":
                yield self._pop(item)
            else:
                kids = self.tree.roots if item < 0 else self.shape.children[item]
                plan = schedule_children(kids, self.shape, self.budgets, self.pack, train=self.train,
                                         live=self.live, path=self.path)
                for batch in plan.rows:
                    yield Rows(batch, (self._forward(len(batch), batch_width(batch, self.shape), 0, self.train),))
                for c in reversed(plan.walk):  # `todo` is a stack: the first walked child goes on last
                    run = self.shape.run(c)
                    pieces = run_pieces(run, self.shape, self.budgets, train=self.train, live=self.live)
                    steps = [("push", p) for p in pieces] + [("children", run[-1])]
                    steps += [("pop", p[0]) for p in reversed(pieces)]
                    todo += reversed(steps)

    def _forward(self, rows: int, length: int, frames: int, grad: bool, offset: int = 0) -> Forward:
        """A forward of `rows x length` tokens after `offset` tokens and `frames` frames above the path."""
        frames += self.frames
        if self.hybrid and length == 1 and frames:
            length = 2
        return Forward(rows, length, self.path + offset, frames, self.live, grad)

    def _push(self, segments: tuple[int, ...], kept: bool) -> Push:
        length = sum(self.shape.lengths[s] for s in segments)
        if kept:
            op = Push(segments, None, (self._forward(1, length, 0, self.train),))
            n_frames = 1
            if self.train:
                self.live += length
        else:
            blocks = tuple(block_bounds(length, self.budgets.block_size, min_block=2 if self.hybrid else 1))
            op = Push(segments, blocks, tuple(self._forward(1, hi - lo, k, False, lo)
                                              for k, (lo, hi) in enumerate(blocks)))
            n_frames = len(blocks)
        self.path += length
        self.frames += n_frames
        self.pushed[segments] = op
        return op

    def _pop(self, segments: tuple[int, ...]) -> Pop:
        push = self.pushed.pop(segments)
        length = sum(self.shape.lengths[s] for s in segments)
        self.path -= length
        if push.blocks is None:
            self.frames -= 1
            if self.train:
                self.live -= length
            return Pop(segments, None, ())
        self.frames -= len(push.blocks)
        forwards = ()
        if self.train:  # each block re-forwarded after the earlier blocks' keys, last to first
            forwards = tuple(self._forward(1, hi - lo, k, True, lo) for k, (lo, hi) in reversed(list(enumerate(
                push.blocks))))
        return Pop(segments, push.blocks, forwards)

r"""The schedule: how the children of a segment run, decided before any of them runs.

Under the current path the walk reaches a segment's children (the roots, for the empty path). A child's subtree is

- a **chain** when it never branches (every segment of it but the last has one child; the per-turn rows of an agent
  episode, a leaf): it runs as one **causal row** of a batched forward, all its segments at once, or, when it does
  not fit the budgets as a row, walked as one fused run (below);
- a **branching** subtree: packed into a **tree row** (its tokens at their depths, a tree mask inside the row,
  `rows.py`) when the cost model prices that below walking it ([`pack_decisions`]: one forward whose attention covers
  the whole row, masked pairs included, against the walk's forwards of causal runs), or when it is at most
  `max_pack_tokens` tokens if that is set;
- else **walked**: its *run* (the child and its single-child descendants, down to the first segment that branches
  or ends the subtree) is pushed as one fused forward, kept or recomputed in blocks over the whole run, then the
  run's last segment's children are scheduled the same way, then the run is popped.

Rows are laid out by [`row_layout`]: either one subtree per row, each row padded to the longest of its batch (as
before), or **shared rows**: several subtrees side by side in one pre-order row (first-fit decreasing), which
removes the padding at the price of a tree mask over the shared row. A [`RowCost`] from the model's shape prices
both (linear work per token, attention per query-key pair, a fixed cost per model call) and the cheaper one runs,
never with more padded tokens than one subtree per row.

The decision depends only on the tree, the budgets and the graph tokens already kept on the path (`live`), which
running rows does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The fixed cost of one model call (a forward and its backward), which makes a schedule of many small forwards slower
# than its FLOPs say: about 124 aten ops per decoder layer plus 200 (a profile of the walk, forward and backward), each
# a launch and its Python dispatch, and the parameters' traffic: every weight read in the forward and again in the
# backward, and its gradient written (`3 x 4` bytes per float32 parameter, whatever the call's length). Per device:
# (seconds per op, bytes/s of that traffic, FLOP/s of the matmuls), per thread on a CPU. Measured on this project's
# CPU (one AVX-512 thread; a forward+backward of 1 token against 64 and 256): SmolLM2-135M's call costs what 55 of its
# tokens cost (this model: 38), the 4-layer benchmark model's 41 (this model: 73). A CUDA launch plus dispatch, an
# H100/H200's HBM and its bf16 matmuls at ~40% of peak: SmolLM2's call costs ~12,600 tokens there. The call is
# converted into the forward FLOPs a training token costs in that time (training: 3 forwards' FLOPs per token).
OPS_PER_LAYER, OPS_PER_CALL = 124, 200
TRAIN_FLOPS = 3
CALL_COST = {"cpu": (10e-6, 8e9, 1e11), "cuda": (5e-6, 3e12, 4e14)}


@dataclass(frozen=True)
class RowCost:
    """Relative cost of a forward of rows (and its backward, which scales with it), in forward FLOPs.

    A forward of `rows` rows of `width` tokens under a path of `path` tokens costs

    ```
    token * rows * width                      projections, MLPs (and recurrent layers): per token
    + key * rows * width * path               every new query over the path's keys (two-part attention)
    + key * rows * own(width)                 each row's queries over its own keys: width (width + 1) / 2 in a
                                              causal row; width^2 under a tree mask (the kernels compute the
                                              masked pairs too)
    + call                                    the fixed cost of the model call
    ```

    Args:
        token (`float`): linear forward FLOPs per token (`ModelShape.linear_flops_per_token`).
        key (`float`): attention forward FLOPs per query-key pair (`ModelShape.attention_flops_per_key`).
        call (`float`, *optional*, defaults to `0.0`): a model call's fixed cost in FLOPs ([`CALL_COST`]).
    """

    token: float
    key: float
    call: float = 0.0

    @classmethod
    def from_shape(cls, shape, device_type: str = "cpu", threads: int = 1) -> RowCost:
        """The cost model of a model shape (`trl_dta.flops.ModelShape`) on a device type (`"cpu"`, `"cuda"`; others
        are priced as CUDA), with `threads` CPU threads running the matmuls ([`CALL_COST`])."""
        op_seconds, bandwidth, rate = CALL_COST.get(device_type, CALL_COST["cuda"])
        if device_type == "cpu":
            rate, bandwidth = rate * max(threads, 1), bandwidth * max(threads, 1)
        params = shape.linear_flops_per_token / 2 + shape.vocab_size * shape.hidden_size  # weights a call touches
        seconds = (OPS_PER_LAYER * shape.num_layers + OPS_PER_CALL) * op_seconds + 3 * 4 * params / bandwidth
        call = seconds * rate / TRAIN_FLOPS
        return cls(float(shape.linear_flops_per_token), float(max(shape.attention_flops_per_key, 1)), call)

    def forward(self, rows: int, width: int, path: int, causal: bool) -> float:
        """The cost of one forward (see the class docstring)."""
        own = width * (width + 1) / 2 if causal else width * width
        return self.token * rows * width + self.key * rows * (width * path + own) + self.call

# Without a model shape (a schedule computed on its own): linear work per token worth 1,024 keys, a call worth 16
# tokens.
DEFAULT_COST = RowCost(token=1024.0, key=1.0, call=16 * 1024.0)


@dataclass(frozen=True)
class Budgets:
    """The engine's size knobs (see [`DTAEngine`] for their meaning) and its cost model.

    Args:
        max_pack_tokens (`int`, *optional*): a branching subtree of at most this many tokens is packed into a tree
            row; None: the cost model decides ([`pack_decisions`]); `0`: no tree row at all (every branching subtree
            walked, one chain per row, no shared rows; a hybrid's recurrence cannot follow a tree mask).
        cost (`RowCost`, *optional*): prices row layouts; defaults to [`DEFAULT_COST`].
    """

    block_size: int
    max_batch_tokens: int
    max_graph_tokens: int | None
    max_pack_tokens: int | None
    lm_head_chunk_size: int
    cost: RowCost = DEFAULT_COST

    @property
    def tree_rows(self) -> bool:
        """Whether rows may carry a tree mask (packed branching subtrees, shared rows)."""
        return self.max_pack_tokens != 0



@dataclass(frozen=True)
class TreeShape:
    """What the schedule needs to know of a tree, per segment, `(n_segments,)` each.

    Args:
        subtree_tokens (`list[int]`): tree tokens of each segment's subtree.
        subtree_segments (`list[int]`): segments of each subtree (the pre-order range `s .. s + n - 1`).
        chain (`list[bool]`): whether the subtree is a chain (it never branches).
        run_end (`list[int]`): the last segment of the run starting at each segment (following single children).
        children (`list[list[int]]`): each segment's children.
        lengths (`list[int]`): each segment's tokens.
        starts (`list[int]`): each segment's depth (the path tokens above it).
    """

    subtree_tokens: list[int]
    subtree_segments: list[int]
    chain: list[bool]
    run_end: list[int]
    children: list[list[int]]
    lengths: list[int]
    starts: list[int]

    @classmethod
    def of(cls, tree) -> TreeShape:
        segs = tree.segments
        run_end = list(range(len(segs)))
        for s in reversed(segs):  # children come after their parent in pre-order
            if len(s.children) == 1:
                run_end[s.index] = run_end[s.children[0]]
        chain = [not segs[run_end[s.index]].children for s in segs]
        return cls(tree.subtree_tokens(), tree.subtree_segments(), chain, run_end, [list(s.children) for s in segs],
                   [s.length for s in segs], [s.start for s in segs])

    def run(self, s: int) -> list[int]:
        """The segments of the run starting at `s`: `s` and its single-child descendants (pre-order: consecutive)."""
        return list(range(s, self.run_end[s] + 1))


@dataclass
class ChildSchedule:
    """What to do with the children of one segment, in execution order.

    Args:
        rows (`list[tuple[tuple[int, ...], ...]]`): batched forwards, each a tuple of rows, each row the subtree
            roots it holds side by side (pre-order each). In this order, before `walk`.
        walk (`list[int]`): children walked (their runs pushed, their own children scheduled, popped), in this order
            (smallest subtree first).
    """

    rows: list[tuple[tuple[int, ...], ...]] = field(default_factory=list)
    walk: list[int] = field(default_factory=list)


def block_bounds(length: int, block_size: int, min_block: int = 1) -> list[tuple[int, int]]:
    """`[lo, hi)` bounds of the recompute blocks of a run of `length` tokens: `block_size` tokens each, the last
    one shorter. With `min_block > 1` (hybrid models, whose layers decode a single token in place) no block is shorter
    than `min_block` unless the whole run is: a short last block joins the one before it (which then holds up to
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


def row_room(budgets: Budgets, train: bool, live: int) -> int:
    """The padded tokens one forward of rows may hold: `max_batch_tokens`, and the graph budget's room in training."""
    room = budgets.max_batch_tokens
    if train and budgets.max_graph_tokens is not None:
        room = min(room, budgets.max_graph_tokens - live)
    return room


def pack_decisions(shape: TreeShape, budgets: Budgets) -> list[bool]:
    """Per segment, whether its subtree runs as one row (when it fits the budgets there) rather than walked.

    A chain always does (one causal row costs what its walk costs, less the push). A branching subtree does when
    `max_pack_tokens` is set and it is at most that many tokens, or, with `max_pack_tokens=None`, when the cost model
    prices it below its walk, bottom-up: alone in a tree row of its size (one call, attention over the whole row)
    against its run pushed as one causal forward plus its children, the packed ones in rows (their calls shared,
    `max_batch_tokens` per call) and the others walked. Never beyond `max_batch_tokens`; never with
    `max_pack_tokens=0`.
    """
    n = len(shape.lengths)
    cost, limit, batch = budgets.cost, budgets.max_pack_tokens, budgets.max_batch_tokens
    pack = [False] * n
    row = [0.0] * n  # a subtree alone in a row, without the call
    walk = [0.0] * n  # a subtree walked, calls included
    for s in reversed(range(n)):  # children after their parent in pre-order: bottom-up
        size, depth = shape.subtree_tokens[s], shape.starts[s]
        row[s] = cost.forward(1, size, depth, causal=shape.chain[s]) - cost.call
        if shape.chain[s]:
            pack[s] = size <= batch
            continue
        end = shape.run_end[s]
        kids = shape.children[end]
        packed = sum(shape.subtree_tokens[c] for c in kids if pack[c])
        walk[s] = (cost.forward(1, shape.starts[end] + shape.lengths[end] - depth, depth, causal=True)
                   + -(-packed // batch) * cost.call + sum(row[c] if pack[c] else walk[c] for c in kids))
        if limit is None:
            pack[s] = size <= batch and row[s] + cost.call <= walk[s]
        else:
            pack[s] = size <= min(limit, batch)
    return pack


def schedule_children(children: list[int], shape: TreeShape, budgets: Budgets, pack: list[bool], *, train: bool,
                      live: int, path: int) -> ChildSchedule:
    """Plan the children of one segment (see the module docstring).

    Args:
        children (`list[int]`): the child segments (the tree's roots for the empty path).
        shape (`TreeShape`): the tree's per-segment facts.
        budgets (`Budgets`): the engine's knobs and cost model.
        pack (`list[bool]`): `(n_segments,)` [`pack_decisions`].
        train (`bool`): whether the graph budget applies (only autograd graphs count against it).
        live (`int`): graph tokens kept on the current path.
        path (`int`): tokens on the current path (the rows' queries attend them).
    """
    room = row_room(budgets, train, live)
    rows, walk = [], []
    for c in children:
        (rows if pack[c] and shape.subtree_tokens[c] <= room else walk).append(c)
    layout = row_layout(rows, shape, budgets.cost, room=room, path=path, shared=budgets.tree_rows)
    return ChildSchedule(layout, sorted(walk, key=shape.subtree_tokens.__getitem__))


def row_layout(items: list[int], shape: TreeShape, cost: RowCost, *, room: int, path: int,
               shared: bool) -> list[tuple[tuple[int, ...], ...]]:
    """The forwards of subtree rows, the cheapest by `cost` of: one subtree per row, batched and padded
    ([`padded_rows`]); one subtree per forward (no padding, a call each); and, when `shared`, the layouts of shared
    rows ([`shared_rows`]) that pad no more tokens than the first (see the module docstring). Every item fits `room`
    on its own.

    Returns:
        `list[tuple[tuple[int, ...], ...]]`: the batches, each a tuple of rows, each the roots it holds.
    """
    if not items:
        return []
    padded = padded_rows(items, shape, room)
    candidates = [padded]
    if len(items) > 1:
        candidates.append([((c,),) for c in sorted(items, key=shape.subtree_tokens.__getitem__)])
        if shared:
            limit = layout_tokens(padded, shape)
            candidates += [layout for layout in shared_rows(items, shape, room)
                           if layout_tokens(layout, shape) <= limit]
    return min(candidates, key=lambda layout: layout_cost(layout, shape, cost, path))


def padded_rows(items: list[int], shape: TreeShape, room: int) -> list[tuple[tuple[int, ...], ...]]:
    """One subtree per row, sorted by size and grouped so that each batch's padded size (rows x its longest row)
    fits `room`."""
    sizes = shape.subtree_tokens
    out, cur = [], []
    for c in sorted(items, key=sizes.__getitem__):  # a batch's padded size: its last row's size times its rows
        if cur and (len(cur) + 1) * sizes[c] > room:
            out.append(tuple(cur))
            cur = []
        cur.append((c,))
    if cur:
        out.append(tuple(cur))
    return out


def shared_rows(items: list[int], shape: TreeShape, room: int):
    """Candidate layouts of shared rows: for row widths from the largest subtree up to `room` (doubling, then `room`
    and the total), the subtrees first-fit decreasing into rows of that width, `room // width` rows per batch."""
    sizes = shape.subtree_tokens
    order = sorted(items, key=lambda c: (-sizes[c], c))
    largest, total = sizes[order[0]], sum(sizes[c] for c in items)
    top = min(room, total)
    widths, w = {top}, largest
    while w < top:
        widths.add(w)
        w *= 2
    for width in sorted(widths):
        bins: list[list[int]] = []
        free: list[int] = []
        for c in order:
            for b, space in enumerate(free):
                if sizes[c] <= space:
                    bins[b].append(c)
                    free[b] -= sizes[c]
                    break
            else:
                bins.append([c])
                free.append(width - sizes[c])
        per_batch = max(room // width, 1)
        rows = [tuple(b) for b in bins]
        yield [tuple(rows[i : i + per_batch]) for i in range(0, len(rows), per_batch)]


def batch_width(batch: tuple[tuple[int, ...], ...], shape: TreeShape) -> int:
    """Tokens per row of a batch as forwarded: its widest row."""
    return max(sum(shape.subtree_tokens[r] for r in row) for row in batch)


def causal_batch(batch: tuple[tuple[int, ...], ...], shape: TreeShape) -> bool:
    """Whether every row of a batch is one chain (plain causal rows continuing the path; no tree mask)."""
    return all(len(row) == 1 and shape.chain[row[0]] for row in batch)


def shared_batch(batch: tuple[tuple[int, ...], ...]) -> bool:
    """Whether some row of a batch holds several subtrees (its attention then runs subtree by subtree)."""
    return any(len(row) > 1 for row in batch)


def batch_cost(batch: tuple[tuple[int, ...], ...], shape: TreeShape, cost: RowCost, path: int) -> float:
    """[`RowCost.forward`] of one batch; a batch with shared rows attends subtree by subtree (its rows' padding
    among itself), so its own pairs are those of its subtrees (`rows.py`, `kernels.two_part_attention`'s spans)."""
    rows, width = len(batch), batch_width(batch, shape)
    if not shared_batch(batch):
        return cost.forward(rows, width, path, causal_batch(batch, shape))
    own = 0
    for row in batch:
        sizes = [shape.subtree_tokens[r] for r in row]
        own += sum(n * (n + 1) / 2 if shape.chain[r] else n * n for r, n in zip(row, sizes))
        pad = width - sum(sizes)
        own += pad * (pad + 1) / 2
    return cost.token * rows * width + cost.key * (rows * width * path + own) + cost.call


def layout_tokens(layout, shape: TreeShape) -> int:
    """Padded tokens of a layout (rows x width, summed over its batches)."""
    return sum(len(batch) * batch_width(batch, shape) for batch in layout)


def layout_cost(layout, shape: TreeShape, cost: RowCost, path: int) -> float:
    """[`batch_cost`] summed over a layout's batches."""
    return sum(batch_cost(b, shape, cost, path) for b in layout)


def run_pieces(run: list[int], shape: TreeShape, budgets: Budgets, *, train: bool,
               live: int) -> list[tuple[tuple[int, ...], bool]]:
    """Cut a walked run into pushes: `(segments, kept)` each, in order. A kept piece is one forward with grad (in
    training) of consecutive segments that fit the graph budget beside what the path keeps, at most
    `max_batch_tokens` tokens unless it is a single segment; the segments that do not fit are pushed together in
    recompute blocks (`kept=False`)."""
    pieces: list[tuple[list[int], bool]] = []
    for s in run:
        n = shape.lengths[s]
        kept = graph_fits(budgets, train, live, n)
        if pieces and pieces[-1][1] == kept:
            tokens = sum(shape.lengths[g] for g in pieces[-1][0]) + n
            if not kept or tokens <= budgets.max_batch_tokens:
                pieces[-1][0].append(s)
                if kept and train:
                    live += n
                continue
        pieces.append(([s], kept))
        if kept and train:
            live += n
    return [(tuple(p), kept) for p, kept in pieces]

r"""Prefix tree (radix trie) over a batch of token sequences.

The rollouts of a batch share prefixes: the prompt of a GRPO group, the system prompt and earlier turns of agent
trajectories. `PrefixTree` stores each distinct prefix once, as a tree of *segments* (maximal runs of tokens without a
branch or a sequence end inside), and gives the maps that the engine and the balancer need:

```
seqs:  a b c d        segments:        [a b] ---- [c d]      (seq 0 ends at [c d])
       a b c e                            \ \---- [c e]      (seq 1)
       a b                                 (seq 2 ends at [a b], an internal segment)
```

A token's *depth* is its position in every sequence that contains it, so positions ids (and RoPE) agree with the
dense computation. Segment ends are placed at every branch point and every sequence end, so each sequence ends
exactly at the end of one segment.

Construction is sort-and-LCP: sequences are sorted lexicographically (C-level list comparison), the longest common
prefix of neighbours is found with a vectorised comparison, and the segments are built with one stack pass (the
suffix-tree-from-LCP-array construction). No Python object is created per token.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

import numpy as np
import torch

from ._checks import is_int


@dataclass
class Segment:
    """One node of the radix trie.

    Args:
        index (`int`): position of the segment in `PrefixTree.segments` (pre-order DFS, lexicographic).
        parent (`int`): index of the parent segment, `-1` for a root segment (its first token has no context).
        start (`int`): depth of the first token (= number of tokens of all ancestors).
        end (`int`): depth one past the last token; the segment holds `end - start >= 1` tokens.
        rep (`int`): a sequence that contains this segment (its tokens are `seqs[rep][start:end]`).
        children (`list[int]`): child segments, lexicographic by first token.
        ends (`list[int]`): sequences that end exactly at `end` (several for duplicates).
        offset (`int`): index of the first token in the flat tree-token numbering (segments in pre-order).
    """

    index: int
    parent: int
    start: int
    end: int
    rep: int
    children: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    offset: int = 0

    @property
    def length(self) -> int:
        return self.end - self.start


def _as_int_list(seq, i: int) -> list[int]:
    """Token ids of sequence `i` as a list of Python ints; refuses anything that is not a 1-D run of integer ids."""
    name = f"seqs[{i}]"
    where = f"`{name}`"
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1:
            raise ValueError(f"{where} must be a 1-D tensor of token ids, got shape {tuple(seq.shape)}.")
        if seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool:
            raise TypeError(f"{where} must hold integer token ids, got dtype {seq.dtype}; pass `.long()` token ids.")
        if seq.device.type == "meta":
            raise ValueError(f"{where} is on the meta device (it holds no token ids); pass a tensor with data.")
        ids = seq.tolist()
    elif isinstance(seq, np.ndarray):
        if seq.ndim != 1:
            raise ValueError(f"{where} must be a 1-D array of token ids, got shape {seq.shape}.")
        if seq.dtype.kind not in "iu":
            raise TypeError(f"{where} must hold integer token ids, got dtype {seq.dtype}.")
        ids = seq.tolist()
    elif isinstance(seq, (str, bytes)) or not isinstance(seq, Iterable):
        raise TypeError(
            f"{where} must be a list of token ids or a 1-D integer tensor, got {type(seq).__name__}; tokenize text "
            "first."
        )
    else:
        ids = list(seq)
        if not all(type(t) is int for t in ids):
            for j, t in enumerate(ids):
                if not is_int(t):
                    raise TypeError(f"`{name}[{j}]` must be an integer token id, got {t!r} of type {type(t).__name__}.")
            ids = [int(t) for t in ids]
    if ids and min(ids) < 0:
        raise ValueError(f"{where} has a negative token id ({min(ids)}); token ids are indices into the vocabulary.")
    return ids


def _check_ids_tensor(name: str, ids, ndim: int, shape: str) -> None:
    """Refuse anything but an integer token-id tensor of `ndim` dimensions, naming `name`."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor of shape {shape}, got {type(ids).__name__}.")
    if ids.dim() != ndim:
        raise ValueError(f"`{name}` must have shape {shape}, got {tuple(ids.shape)}.")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"`{name}` must hold integer token ids, got dtype {ids.dtype}; pass `.long()` token ids.")
    if ids.device.type == "meta":
        raise ValueError(f"`{name}` is on the meta device (it holds no token ids); pass a tensor with data.")


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixTree:
    """Radix trie over token sequences.

    Build it with [`PrefixTree.from_sequences`] or [`PrefixTree.from_padded`].

    Attributes:
        seqs (`list[torch.LongTensor]`): the sequences, each of shape `(len_i,)`, in input order.
        segments (`list[Segment]`): the trie's segments in pre-order (lexicographic DFS).
        roots (`list[int]`): root segments (sequences that share no first token live in different roots).
        empty (`list[int]`): sequences of length 0 (they own no segment).
        end_segment (`list[int]`): for each sequence, the segment it ends at (`-1` for an empty sequence).
        order (`list[int]`): sequence indices in lexicographic (DFS leaf) order.
        order_lcp (`list[int]`): `order_lcp[k]` = longest common prefix of `order[k-1]` and `order[k]` (0 for k=0).
    """

    def __init__(self, seqs: list[torch.Tensor], token_lists: list[list[int]]):
        self.seqs = seqs
        self.lengths = [len(t) for t in token_lists]
        n = len(token_lists)
        order = sorted(range(n), key=token_lists.__getitem__)
        arrays = [np.asarray(t, dtype=np.int64) for t in token_lists]
        order_lcp = [0] * n
        for k in range(1, n):
            order_lcp[k] = _lcp(arrays[order[k - 1]], arrays[order[k]])
        self.order = order
        self.order_lcp = order_lcp

        segments: list[Segment] = []
        roots: list[int] = []
        end_segment = [-1] * n
        empty: list[int] = []
        stack: list[int] = []  # segment ids on the path of the previous sequence

        for k, i in enumerate(order):
            length = self.lengths[i]
            shared = order_lcp[k]
            while stack and segments[stack[-1]].start >= shared:
                stack.pop()
            if stack and segments[stack[-1]].end > shared:
                # Split the top segment at `shared`: its tail (with its children and ends) becomes a new child.
                top = segments[stack[-1]]
                tail = Segment(len(segments), top.index, shared, top.end, top.rep, top.children, top.ends)
                segments.append(tail)
                for c in tail.children:
                    segments[c].parent = tail.index
                for s in tail.ends:
                    end_segment[s] = tail.index
                top.end, top.children, top.ends = shared, [tail.index], []
            if length == 0:
                empty.append(i)
                continue
            if length > shared:
                parent = stack[-1] if stack else -1
                seg = Segment(len(segments), parent, shared, length, i)
                segments.append(seg)
                (segments[parent].children if parent >= 0 else roots).append(seg.index)
                stack.append(seg.index)
            top = segments[stack[-1]]
            top.ends.append(i)
            end_segment[i] = top.index

        # Renumber in pre-order so that a segment's subtree is a contiguous index range.
        new_index: dict[int, int] = {}
        preorder: list[Segment] = []
        todo = list(reversed(roots))
        while todo:
            s = todo.pop()
            new_index[s] = len(preorder)
            preorder.append(segments[s])
            todo.extend(reversed(segments[s].children))
        offset = 0
        for seg in preorder:
            seg.index = new_index[seg.index]
            seg.parent = new_index[seg.parent] if seg.parent >= 0 else -1
            seg.children = [new_index[c] for c in seg.children]
            seg.offset = offset
            offset += seg.length
        self.segments = preorder
        self.roots = [new_index[r] for r in roots]
        self.end_segment = [new_index[s] if s >= 0 else -1 for s in end_segment]
        self.empty = empty
        self.n_tree_tokens = offset

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_sequences(cls, seqs: Iterable[Sequence[int] | torch.Tensor | np.ndarray]) -> PrefixTree:
        """Build the tree from sequences of token ids.

        Args:
            seqs (iterable of `list[int]`, 1-D integer `torch.Tensor` or 1-D integer `np.ndarray`): the sequences,
                `(len_i,)` each, in any order and on any device (the tree keeps a CPU copy). Any iterable of them is
                accepted (a list, a tuple, a generator); a 2-D tensor or array is refused (its padding would count as
                tokens: use [`PrefixTree.from_padded`]), and so are unordered containers (sets, dicts), text, floats,
                booleans and negative ids.
        """
        if isinstance(seqs, (torch.Tensor, np.ndarray)):
            raise TypeError(
                "`seqs` must be a list of sequences, got a padded 2-D batch; use `PrefixTree.from_padded(input_ids, "
                "attention_mask)` so that padding is not counted as tokens."
            )
        if isinstance(seqs, (str, bytes, Mapping, Set)) or not isinstance(seqs, Iterable):
            raise TypeError(
                f"`seqs` must be an ordered iterable (list, tuple, generator) of token-id sequences, got "
                f"{type(seqs).__name__}."
            )
        seqs = list(seqs)
        token_lists = [_as_int_list(s, i) for i, s in enumerate(seqs)]
        tensors = [
            s.detach().to("cpu", torch.long) if isinstance(s, torch.Tensor) else torch.tensor(t, dtype=torch.long)
            for s, t in zip(seqs, token_lists)
        ]
        return cls(tensors, token_lists)

    @classmethod
    def from_padded(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> PrefixTree:
        """Build the tree from a padded batch.

        Args:
            input_ids (`torch.LongTensor` of shape `(batch, seq_len)`): integer token ids, left- or right-padded (or
                both, as in TRL's left-padded prompt followed by a right-padded completion).
            attention_mask (`torch.Tensor` of shape `(batch, seq_len)`, *optional*): bool or integer, 1 for real
                tokens and 0 for padding. The real tokens of each row, in order, form that row's sequence. Without a
                mask every position is real.
        """
        _check_ids_tensor("input_ids", input_ids, 2, "(batch, seq_len)")
        if attention_mask is None:
            return cls.from_sequences(list(input_ids.cpu()))
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(
                f"`attention_mask` must be a torch.Tensor of shape {tuple(input_ids.shape)} or None, got "
                f"{type(attention_mask).__name__}."
            )
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"`attention_mask` shape {tuple(attention_mask.shape)} must equal `input_ids` shape "
                f"{tuple(input_ids.shape)}."
            )
        if attention_mask.is_floating_point() or attention_mask.is_complex():
            raise TypeError(
                f"`attention_mask` must be a bool or integer tensor of 0/1, got dtype {attention_mask.dtype}; pass "
                "`attention_mask.long()` if it holds exact 0/1 values."
            )
        ids, mask = input_ids.cpu(), attention_mask.cpu()
        if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("`attention_mask` must hold only 0 (padding) and 1 (real token).")
        return cls.from_sequences([row[m] for row, m in zip(ids, mask.bool())])

    # ------------------------------------------------------------------ statistics

    @property
    def n_sequences(self) -> int:
        return len(self.seqs)

    @property
    def n_tokens(self) -> int:
        """Sum of the sequence lengths (what a dense trainer computes, padding excluded)."""
        return sum(self.lengths)

    @property
    def compression_ratio(self) -> float:
        """`n_tokens / n_tree_tokens`: the ideal speed-up of token-linear work (1.0 for an empty batch)."""
        return self.n_tokens / self.n_tree_tokens if self.n_tree_tokens else 1.0

    @property
    def max_path_len(self) -> int:
        return max(self.lengths, default=0)

    @property
    def n_segments(self) -> int:
        return len(self.segments)

    @property
    def n_leaves(self) -> int:
        """Segments without children."""
        return sum(1 for s in self.segments if not s.children)

    @property
    def depth(self) -> int:
        """Largest number of segments on one root-to-leaf path."""
        depth = [0] * len(self.segments)
        for seg in self.segments:  # pre-order: parents first
            depth[seg.index] = 1 + (depth[seg.parent] if seg.parent >= 0 else 0)
        return max(depth, default=0)

    def stats(self) -> dict[str, float]:
        """The tree's shape as a flat dict (for logging and the analyzer)."""
        return {
            "sequences": self.n_sequences,
            "tokens": self.n_tokens,
            "tree_tokens": self.n_tree_tokens,
            "compression_ratio": self.compression_ratio,
            "max_path_len": self.max_path_len,
            "segments": self.n_segments,
            "leaves": self.n_leaves,
            "depth": self.depth,
        }

    # ------------------------------------------------------------------ maps

    def tokens(self, segment: int) -> torch.LongTensor:
        """Token ids of a segment, shape `(length,)`."""
        seg = self.segments[segment]
        return self.seqs[seg.rep][seg.start : seg.end]

    def path(self, i: int) -> list[int]:
        """Segments from the root to the end of sequence `i` (empty for an empty sequence)."""
        out = []
        s = self.end_segment[i]
        while s >= 0:
            out.append(s)
            s = self.segments[s].parent
        return out[::-1]

    def token_index(self, i: int) -> torch.LongTensor:
        """Map from positions of sequence `i` to flat tree-token indices, shape `(len_i,)`.

        Two sequences share a tree token exactly when they agree on all tokens up to and including it.
        """
        parts = [
            torch.arange(self.segments[s].offset, self.segments[s].offset + self.segments[s].length)
            for s in self.path(i)
        ]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def tree_token_ids(self) -> torch.LongTensor:
        """Token id of every tree token, shape `(n_tree_tokens,)`, in the flat numbering."""
        parts = [self.tokens(s.index) for s in self.segments]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def subtree_reduce(self, values: Sequence, op: Callable = operator.add) -> list:
        """Fold a per-segment value over every subtree: `out[s] = op(values[s], out[c] for each child c)`.

        One reverse pre-order pass (children come after their parent, so each child is final before it is folded
        into its parent). `op=operator.add` sums (tokens, segments), `op=min` takes the minimum.

        Args:
            values (`Sequence`): one value per segment, `(n_segments,)`.
            op (`Callable`, *optional*, defaults to `operator.add`): associative combination of two values.
        """
        out = list(values)
        for seg in reversed(self.segments):
            if seg.parent >= 0:
                out[seg.parent] = op(out[seg.parent], out[seg.index])
        return out

    def subtree_tokens(self) -> list[int]:
        """Tree tokens in each segment's subtree (itself included), `(n_segments,)`."""
        return self.subtree_reduce([s.length for s in self.segments])

    def subtree_segments(self) -> list[int]:
        """Segments in each segment's subtree (itself included), `(n_segments,)`: the subtree of `s` is the pre-order
        range `s .. s + subtree_segments()[s] - 1`."""
        return self.subtree_reduce([1] * len(self.segments))

    # ------------------------------------------------------------------ variants

    def unshared(self, min_length: int = 2) -> PrefixTree:
        """The same sequences with every internal non-root segment shorter than `min_length` copied into the front
        of each of its children (and, where sequences end in it, into a new leaf beside them): no segment that has
        a parent and children is shorter than `min_length`. `self` when there is none.

        The engine runs hybrid models on this tree: a recurrent layer cannot continue a path by a single token
        without its in-place decoding step, so a one-token segment is computed once per child instead of once
        (`engine/walk.py`). The result is no longer a trie (siblings may start with the same token); every sequence
        still ends exactly at the end of one segment, and `n_tree_tokens` counts the copies.

        ```
        a b | c | d e        a b | c d e
                \\ f g   ->       \\ c f g      (seq "a b c" also ends here:  a b | c)
        ```
        """
        short = [s.parent >= 0 and s.children and s.length < min_length for s in self.segments]
        if not any(short):
            return self
        # Nodes (start, end, rep, children, ends), rebuilt top-down: a short internal node is replaced by its children
        # with its tokens in front, and by a leaf copy holding the sequences that end in it.
        def expand(s: int, start: int) -> list[tuple]:
            seg = self.segments[s]
            if seg.parent >= 0 and seg.children and seg.end - start < min_length:
                out = [(start, seg.end, seg.rep, [], list(seg.ends))] if seg.ends else []
                for c in seg.children:
                    out += expand(c, start)
                return out
            kids = [node for c in seg.children for node in expand(c, self.segments[c].start)]
            return [(start, seg.end, seg.rep, kids, list(seg.ends))]

        tree = object.__new__(PrefixTree)
        tree.seqs, tree.lengths, tree.order, tree.order_lcp = self.seqs, self.lengths, self.order, self.order_lcp
        tree.empty = list(self.empty)
        tree.segments, tree.roots, tree.end_segment = [], [], [-1] * len(self.seqs)
        todo = [(node, -1) for r in reversed(self.roots) for node in reversed(expand(r, self.segments[r].start))]
        offset = 0
        while todo:  # pre-order numbering, as the constructor's
            (start, end, rep, kids, ends), parent = todo.pop()
            seg = Segment(len(tree.segments), parent, start, end, rep, [], ends, offset)
            offset += end - start
            tree.segments.append(seg)
            (tree.segments[parent].children if parent >= 0 else tree.roots).append(seg.index)
            for i in ends:
                tree.end_segment[i] = seg.index
            todo += [(node, seg.index) for node in reversed(kids)]
        tree.n_tree_tokens = offset
        return tree

    def __repr__(self) -> str:
        return (
            f"PrefixTree(sequences={self.n_sequences}, tokens={self.n_tokens}, tree_tokens={self.n_tree_tokens}, "
            f"compression_ratio={self.compression_ratio:.3f}, segments={self.n_segments}, depth={self.depth})"
        )


def as_tree(seqs_or_tree) -> PrefixTree:
    """`seqs_or_tree` as a `PrefixTree`: a tree as it is, sequences through `PrefixTree.from_sequences` (which refuses
    anything but an ordered iterable of 1-D integer token-id sequences, naming the offending one)."""
    if isinstance(seqs_or_tree, PrefixTree):
        return seqs_or_tree
    return PrefixTree.from_sequences(seqs_or_tree)

r"""The score plan: which positions each segment projects through the LM head, and how each sequence's log-probs are
reassembled from them. Pure index arithmetic over a [`PrefixTree`]; no model, no tensors.

Sequence `i` of length `len_i` needs the log-probs of its targets at depths `first[i] .. len_i - 1`
(`first[i] = len_i - n_scored[i]`; the target at depth `d` is predicted from the position at depth `d - 1`). A segment
scores a target when some sequence through it needs it. The *outputs* of segment `s`, in order:

- its scored internal targets: positions `p0[s] .. length - 2` of the segment, each predicting the next token of the
  segment (`n_internal[s]` outputs);
- one *fork* per scored child `c` (`fork_children[s]`): the child's first token, predicted from the segment's last
  position (the hidden state is shared by all children). `fork_index[c]` is its index among `s`'s outputs.

Example (`n_scored = [2, 3]`, so `first = [2, 1]`):

```
seq 0:  a b c d          S0 = [a b]  depths 0-1     outputs: [b@1 | c@2 -> S1 | e@2 -> S2]   (p0 = 0)
seq 1:  a b e f          S1 = [c d]  depths 2-3     outputs: [d@3]                          (p0 = 0)
                         S2 = [e f]  depths 2-3     outputs: [f@3]
slices: seq 0 = S0[1:2] + S1[0:1]              -> c@2 d@3   (b@1 is before first[0] = 2)
        seq 1 = S0[0:1] + S0[2:3] + S2[0:1]    -> b@1 e@2 f@3
```

Along its path a sequence takes, from each segment, the internal outputs from its first needed one on, then the
fork to the next segment of its path (when that fork's depth is needed).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..tree import PrefixTree


@dataclass(frozen=True)
class BlockTargets:
    """What block `[lo, hi)` of a segment scores, in output order.

    Args:
        internal (`range`): segment positions whose next token (same segment) is scored.
        forks (`list[int]`): children whose first token is scored from the segment's last position (only in the
            block that ends the segment).
        outputs (`tuple[int, int]`): the slice of the segment's outputs these targets are.
    """

    internal: range
    forks: list[int]
    outputs: tuple[int, int]


class ScorePlan:
    """Scored positions per segment and per-sequence output slices (see the module docstring).

    Args:
        tree (`PrefixTree`): the batch.
        n_scored (`list[int]`): per sequence, how many trailing log-probs it needs, each in `0 .. max(len_i - 1, 0)`.

    Attributes:
        first (`list[int]`): `(n_sequences,)` depth of each sequence's first scored target.
        p0 (`list[int]`): `(n_segments,)` first scored internal position of each segment.
        n_internal (`list[int]`): `(n_segments,)` scored internal targets of each segment.
        fork_children (`list[list[int]]`): per segment, its children whose first token is scored, in output order.
        fork_index (`list[int]`): `(n_segments,)` index of a segment's fork among its parent's outputs (`-1`: none).
    """

    def __init__(self, tree: PrefixTree, n_scored: list[int]):
        self.tree = tree
        segs = tree.segments
        self.first = [n - k for n, k in zip(tree.lengths, n_scored)]
        need = [float("inf")] * len(segs)  # smallest first[i] over the sequences through each segment
        for i, s in enumerate(tree.end_segment):
            if s >= 0:
                need[s] = min(need[s], self.first[i])
        need = tree.subtree_reduce(need, min)
        self.p0 = [int(min(max(need[s.index] - s.start - 1, 0), s.length - 1)) for s in segs]
        self.n_internal = [s.length - 1 - self.p0[s.index] for s in segs]
        self.fork_children = [[c for c in s.children if segs[c].start >= need[c]] for s in segs]
        self.fork_index = [-1] * len(segs)
        for s in segs:
            for j, c in enumerate(self.fork_children[s.index]):
                self.fork_index[c] = self.n_internal[s.index] + j

    def n_outputs(self, s: int) -> int:
        """Number of outputs of segment `s`."""
        return self.n_internal[s] + len(self.fork_children[s])

    def block(self, s: int, lo: int, hi: int) -> BlockTargets:
        """The targets block `[lo, hi)` of segment `s` scores (the whole segment is `[0, length)`)."""
        length, p0, n = self.tree.segments[s].length, self.p0[s], self.n_internal[s]
        first, stop = max(lo, p0), min(hi, length - 1)
        forks = self.fork_children[s] if hi == length else []
        a, b = min(max(lo - p0, 0), n), min(max(hi - p0, 0), n)
        return BlockTargets(range(first, max(stop, first)), forks, (a, b + len(forks)))

    def slices(self, i: int) -> list[tuple[int, int, int]]:
        """`(segment, start, stop)` slices of segment outputs whose concatenation is sequence `i`'s scored log-probs
        (depths `first[i] .. len_i - 1`, in order)."""
        first, segs = self.first[i], self.tree.segments
        path = self.tree.path(i)
        out = []
        for k, s in enumerate(path):
            a = max(first - segs[s].start - 1, 0) - self.p0[s]
            if a < self.n_internal[s]:
                out.append((s, a, self.n_internal[s]))
            if k + 1 < len(path) and segs[s].end >= first:
                j = self.fork_index[path[k + 1]]
                out.append((s, j, j + 1))
        return out

    def output_targets(self, s: int) -> list[tuple[int, int]]:
        """`(segment, offset)` of the tree token each output of `s` predicts (for tests and debugging)."""
        internal = [(s, p + 1) for p in self.block(s, 0, self.tree.segments[s].length).internal]
        return internal + [(c, 0) for c in self.fork_children[s]]

"""What a forward scores: the positions and target ids of a segment's block, or of a block of a fused run.

The [`ScorePlan`] says, in index arithmetic, which targets each block of a segment scores (`ScorePlan.block`); this
module turns that into the tensors a forward projects through the LM head, for one segment or for a *run* (consecutive
segments in pre-order, each the only child of the one before, forwarded as one sequence: `ops.Push`). A run's
outputs are its segments' outputs one after the other, so a block `[lo, hi)` of the run (which may cross segment
ends) scores one contiguous slice of them:

```
run:      [ s1: 4 tokens | s2: 3 tokens ]        block [2, 6): s1's positions 2-3, s2's positions 0-1
outputs:  [ s1: a b c (fork to s2) | s2: d e ]   -> the slice [c, fork, d] of the run's outputs
```
"""

from __future__ import annotations

import torch

from .plan import BlockTargets, ScorePlan


class Targets:
    """Positions and target ids of the blocks of a tree's segments and runs.

    Args:
        plan (`ScorePlan`): what each segment scores.
        tokens (`list[torch.LongTensor]`): per segment, its ids `(length,)` on the model's device.
    """

    def __init__(self, plan: ScorePlan, tokens: list[torch.Tensor]):
        self.plan, self.tokens = plan, tokens
        self.device = tokens[0].device if tokens else torch.device("cpu")
        self.lengths = [s.length for s in plan.tree.segments]
        self.fork_tokens = [torch.stack([tokens[c][0] for c in kids]) if kids else None  # (n_forks,)
                            for kids in plan.fork_children]

    def segment(self, s: int, lo: int, block: BlockTargets) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions relative to `lo` `(n,)` and target ids `(n,)` of a block of segment `s`, in output order."""
        r = block.internal
        pos = torch.arange(r.start - lo, r.stop - lo, device=self.device)
        tgt = self.tokens[s][r.start + 1 : r.stop + 1]
        if block.forks:
            last = self.lengths[s] - 1 - lo
            pos = torch.cat([pos, torch.full((len(block.forks),), last, device=self.device)])
            tgt = torch.cat([tgt, self.fork_tokens[s]])
        return pos, tgt

    def run(self, run: tuple[int, ...], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Positions relative to `lo` `(n,)`, target ids `(n,)` and the slice `[a, b)` of the run's outputs that block
        `[lo, hi)` of the run scores (see the module docstring)."""
        positions, targets, bounds = [], [], []
        start = out = 0
        for s in run:
            n = self.lengths[s]
            seg_lo, seg_hi = max(lo - start, 0), min(hi - start, n)
            if seg_lo < seg_hi:
                block = self.plan.block(s, seg_lo, seg_hi)
                pos, tgt = self.segment(s, seg_lo, block)
                positions.append(pos + (start + seg_lo - lo))
                targets.append(tgt)
                bounds.append((out + block.outputs[0], out + block.outputs[1]))
            start += n
            out += self.plan.n_outputs(s)
        return _cat(positions), _cat(targets), bounds[0][0], bounds[-1][1]

    def ids(self, run: tuple[int, ...]) -> torch.Tensor:
        """The run's token ids `(length,)`, its segments' one after the other."""
        return torch.cat([self.tokens[s] for s in run]) if len(run) > 1 else self.tokens[run[0]]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)

"""Draws `docs/img/walk.png`: the dense batch beside DTA's depth-first walk over its prefix tree.

    python tools/draw_walk.py            # rewrites docs/img/walk.png (matplotlib, from the dev extra)

Five rollouts share a prompt `P`; three continue with turn `A`, two with turn `B`. Left: TRL's dense batch, every
row holding its own copy of the shared tokens (hatched: computed again). Right: the prefix tree, walked depth-first:
`P` forwarded once (its keys/values pushed on the stack), then `A` over them, then `A`'s three leaves in one batched
forward; the leaves' gradients reach `A` summed and go back through it once, `A` is popped, and the same for `B`; `P`
gets the sum of what `A` and `B` sent and is back-propagated once.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "img" / "walk.png"
COLORS = {"P": "#4c72b0", "A": "#55a868", "B": "#c44e52", "leaf": "#dd8452"}
# (segment, length in tokens) per dense row: the prompt, a turn, the row's own completion
ROWS = [("P", 6, "A", 3, "a1", 2), ("P", 6, "A", 3, "a2", 3), ("P", 6, "A", 3, "a3", 1),
        ("P", 6, "B", 4, "b1", 2), ("P", 6, "B", 4, "b2", 3)]


def _box(ax, x, y, w, h, label, color, hatch=None, alpha=1.0):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=0.8, hatch=hatch, alpha=alpha))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=9, color="white", weight="bold")


def _dense(ax) -> None:
    seen = set()
    for r, (p, lp, t, lt, leaf, ll) in enumerate(ROWS):
        y = len(ROWS) - 1 - r
        for x, (name, length, color) in zip((0, lp, lp + lt), ((p, lp, COLORS[p]), (t, lt, COLORS[t]),
                                                              (leaf, ll, COLORS["leaf"]))):
            again = name in seen
            _box(ax, x, y * 1.2, length, 0.9, name, color, hatch="////" if again else None, alpha=0.55 if again else 1)
            seen.add(name)
    dense = sum(lp + lt + ll for _, lp, _, lt, _, ll in ROWS)
    ax.set_title(f"TRL's dense batch: {len(ROWS)} rows, {dense} tokens computed\n"
                 "(hatched: shared tokens computed again)", fontsize=10)
    ax.set_xlim(-0.5, 12.5)
    ax.set_ylim(-0.5, 6.2)
    ax.axis("off")


def _arrow(ax, start, end, color="black", style="-|>", dashed=False):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=10, color=color, linewidth=1.2,
                                 linestyle="--" if dashed else "-", shrinkA=2, shrinkB=2))


def _walk(ax) -> None:
    # node: (x, y, width, label, color)
    nodes = {"P": (4.0, 5.0, 6, "P  (1: once)", COLORS["P"]),
             "A": (0.5, 3.2, 3, "A  (2)", COLORS["A"]), "B": (8.0, 3.2, 4, "B  (4)", COLORS["B"])}
    for x, y, w, label, color in nodes.values():
        _box(ax, x, y, w, 0.9, label, color)
    leaves = {"A": [("a1", 2), ("a2", 3), ("a3", 1)], "B": [("b1", 2), ("b2", 3)]}
    for parent, kids in leaves.items():
        px, py, pw, _, _ = nodes[parent]
        x0 = px - 0.4 if parent == "A" else px + 0.2
        ax.add_patch(Rectangle((x0 - 0.15, 0.75), sum(w for _, w in kids) + 0.45 * (len(kids) - 1) + 0.3, 1.25,
                               fill=False, linestyle=":", edgecolor="gray"))
        ax.text(x0 - 0.1, 0.45, f"({3 if parent == 'A' else 5}) one batched forward", fontsize=8, color="gray")
        x = x0
        for name, w in kids:
            _box(ax, x, 0.9, w, 0.9, name, COLORS["leaf"])
            _arrow(ax, (px + pw / 2, py), (x + w / 2, 1.8))
            x += w + 0.45
    for child in ("A", "B"):
        cx, cy, cw, _, _ = nodes[child]
        _arrow(ax, (7.0, 5.0), (cx + cw / 2, cy + 0.9))
    # gradients: summed at each shared node, back-propagated through it once
    _arrow(ax, (1.6, 1.85), (1.3, 3.15), color="#8172b2", dashed=True)
    _arrow(ax, (9.2, 1.85), (9.4, 3.15), color="#8172b2", dashed=True)
    _arrow(ax, (2.4, 4.15), (4.6, 4.95), color="#8172b2", dashed=True)
    _arrow(ax, (10.6, 4.15), (9.4, 4.95), color="#8172b2", dashed=True)
    ax.text(6.0, 6.35, "keys/values stack: P, then P+A (A popped), then P+B", ha="center", fontsize=8)
    ax.text(13.0, 2.6, "gradients (dashed):\nsummed at A, B and P,\neach back-propagated\nonce", fontsize=8,
            color="#8172b2", va="center")
    tree = sum({name: length for row in ROWS for name, length in zip(row[::2], row[1::2])}.values())
    ax.set_title(f"DTA: the prefix tree walked depth-first, {tree} tokens computed\n"
                 "(numbers: order of the forwards; one root-to-leaf path live)", fontsize=10)
    ax.set_xlim(-0.5, 16.5)
    ax.set_ylim(0.2, 6.6)
    ax.axis("off")


def main() -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 1.35]})
    _dense(left)
    _walk(right)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

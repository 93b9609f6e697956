"""Seeded rollout batches (token ids only) with the prefix-sharing shapes of RL post-training.

* **GRPO single-turn** `grpo(P, G, R)`: `n_prompts` prompts of `P` tokens, each with `G` completions of `R` tokens.
  Compression `G (P + R) / (P + G R)`. The benchmark grid is (P, G, R) in {(256, 8, 1024), (1024, 16, 256),
  (4096, 8, 512)}: 1.2x, 4.0x and 4.5x.
* **Multi-turn agent** `multi_turn(...)`: a system prompt of about 4.8K tokens shared by every rollout; `n_tasks`
  tasks, each with a task prompt and a group of rollouts; `turns` turns (assistant action + tool output, lengths
  drawn around `turn_len`); rollouts of a task share their history up to the turn where they diverge:
  `distinct[j]` is the number of different histories after turn `j` (``(1, 2, 4, 8)``: all 8 rollouts agree on the
  first turn, then split in two at each turn, like a tree search over actions). The default is about 9x (agentic
  benchmarks such as tau^2-bench airline measure 9.4x); `MULTI_TURN_3X` is about 3x.
* **No sharing** `no_sharing(N, L)`: `N` sequences of `L` tokens with distinct first tokens (compression 1.0), the
  control where a tree method can only lose.
* **tau2-bench airline** `tau2_airline(tasks, group)`: real agent episodes (gold actions and variants of them, tau2's
  system prompt, tool schemas and database outputs, a real BPE) in the per-turn layout (one row per agent turn, the
  conversation up to it), read from the token file `tau2.write_token_file` wrote; no tau2 needed.

Sibling branches get distinct first tokens, so that the trie's shape (and the compression ratio) is exactly the one
intended, not blurred by chance collisions of random tokens.

**Scaling.** Every builder takes `scale`: all lengths (prompt, completion, system prompt, task prompt, turn lengths)
are multiplied by it; counts (prompts, group sizes, tasks, turns) are not. Compression is (nearly) scale-free since
tree tokens and dense tokens both scale linearly, while attention's share of the work shrinks with shorter
sequences. `--quick` runs use `scale=1/4` for GRPO and `1/8` for the multi-turn workloads (11K rollout tokens) so
that every method of every workload runs in a few seconds on a 2-core CPU; `--full` uses `scale=1`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FIRST_ID = 3  # ids 0-2 are left for special tokens


@dataclass
class Workload:
    """A batch of rollouts.

    Args:
        name (`str`): short label for tables and CSV files.
        seqs (`list[torch.LongTensor]`): the rollouts, each of shape `(len_i,)`, in the order a trainer would see.
        description (`str`): how it was built.
        params (`dict`): the builder's arguments.
    """

    name: str
    seqs: list[torch.Tensor]
    description: str = ""
    params: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.seqs)

    def tree(self):
        from trl_dta.tree import PrefixTree

        return PrefixTree.from_sequences(self.seqs)


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


class _Tokens:
    """Seeded token source with distinct first tokens for siblings."""

    def __init__(self, vocab_size: int, seed: int):
        if vocab_size <= FIRST_ID + 64:
            raise ValueError(f"vocab_size must exceed {FIRST_ID + 64}, got {vocab_size}")
        self.vocab = vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def run(self, n: int) -> torch.Tensor:
        return torch.randint(FIRST_ID, self.vocab, (n,), generator=self.gen)

    def siblings(self, lengths: list[int]) -> list[torch.Tensor]:
        """Runs of the given lengths whose first tokens differ pairwise."""
        if len(lengths) > self.vocab - FIRST_ID:
            raise ValueError(f"{len(lengths)} siblings need more than {self.vocab - FIRST_ID} distinct tokens")
        firsts = torch.randperm(self.vocab - FIRST_ID, generator=self.gen)[: len(lengths)] + FIRST_ID
        out = []
        for first, n in zip(firsts.tolist(), lengths):
            run = self.run(n)
            run[0] = first
            out.append(run)
        return out


def grpo(
    prompt_len: int,
    group: int,
    completion_len: int,
    n_prompts: int = 1,
    scale: float = 1.0,
    vocab_size: int = 4096,
    seed: int = 0,
) -> Workload:
    """Single-turn GRPO: `n_prompts` prompts, each followed by `group` completions (distinct first tokens).

    Args:
        prompt_len (`int`): prompt tokens (before scaling).
        group (`int`): completions per prompt.
        completion_len (`int`): tokens per completion (before scaling).
        n_prompts (`int`, *optional*, defaults to `1`): prompts in the batch (distinct first tokens).
        scale (`float`, *optional*, defaults to `1.0`): length multiplier.
        vocab_size (`int`, *optional*, defaults to `4096`): ids are drawn from `[3, vocab_size)`.
        seed (`int`, *optional*, defaults to `0`): RNG seed.
    """
    P, R = _scaled(prompt_len, scale), _scaled(completion_len, scale)
    tok = _Tokens(vocab_size, seed)
    seqs = []
    for prompt in tok.siblings([P] * n_prompts):
        for completion in tok.siblings([R] * group):
            seqs.append(torch.cat([prompt, completion]))
    return Workload(
        name=f"grpo-p{prompt_len}-g{group}-c{completion_len}",
        seqs=seqs,
        description=f"{n_prompts} prompt(s) of {P} tokens x {group} completions of {R} tokens",
        params=dict(prompt_len=P, group=group, completion_len=R, n_prompts=n_prompts, scale=scale),
    )


def multi_turn(
    system_len: int = 4800,
    n_tasks: int = 2,
    group: int = 8,
    task_len: int = 200,
    turns: int = 4,
    turn_len: int = 150,
    distinct: tuple[int, ...] = (1, 2, 4, 8),
    scale: float = 1.0,
    vocab_size: int = 4096,
    seed: int = 0,
    name: str = "multiturn-9x",
) -> Workload:
    """Multi-turn agent rollouts: shared system prompt, per-task prompt, turns with shared history.

    Rollout `g` of a task follows history class `g // (group // distinct[j])` after turn `j`, so rollouts in the same
    class share every turn up to `j`. Turn lengths are drawn uniformly from `[turn_len / 2, 3 turn_len / 2]`.

    ```
    system ── task 0 ── turn 0 ─┬─ turn 1 ─┬─ turn 2 ...      distinct = (1, 2, 4, ...)
                               │          └─ turn 2 ...
                               └─ turn 1 ─┬─ ...
           └─ task 1 ── ...
    ```

    Args:
        system_len (`int`, *optional*, defaults to `4800`): system prompt tokens (before scaling).
        n_tasks (`int`, *optional*, defaults to `2`): tasks (distinct task prompts).
        group (`int`, *optional*, defaults to `8`): rollouts per task.
        task_len (`int`, *optional*, defaults to `200`): task prompt tokens (before scaling).
        turns (`int`, *optional*, defaults to `4`): turns per rollout.
        turn_len (`int`, *optional*, defaults to `150`): mean tokens per turn (before scaling).
        distinct (`tuple[int, ...]`, *optional*, defaults to `(1, 2, 4, 8)`): different histories after each turn;
            each must divide `group`, non-decreasing, the last equal to `group` (no duplicate rollouts).
        scale (`float`, *optional*, defaults to `1.0`): length multiplier.
        vocab_size (`int`, *optional*, defaults to `4096`): ids are drawn from `[3, vocab_size)`.
        seed (`int`, *optional*, defaults to `0`): RNG seed.
        name (`str`, *optional*, defaults to `"multiturn-9x"`): workload label.
    """
    if len(distinct) != turns:
        raise ValueError(f"`distinct` needs one entry per turn ({turns}), got {distinct}")
    if any(group % d for d in distinct) or list(distinct) != sorted(distinct) or distinct[-1] != group:
        raise ValueError(f"`distinct` must be non-decreasing divisors of group={group} ending at it, got {distinct}")
    tok = _Tokens(vocab_size, seed)
    len_gen = torch.Generator().manual_seed(seed + 1)
    S, T, L = _scaled(system_len, scale), _scaled(task_len, scale), _scaled(turn_len, scale)
    system = tok.run(S)
    seqs = []
    for task in tok.siblings([T] * n_tasks):
        # histories[c] = token runs of history class c after the current turn
        histories = [[system, task]]
        prev = 1
        for d in distinct:
            lengths = torch.randint(max(1, L // 2), max(2, 3 * L // 2 + 1), (d,), generator=len_gen).tolist()
            # each of the `prev` classes splits into d // prev children with distinct first tokens
            new = []
            for c in range(prev):
                children = tok.siblings(lengths[c * (d // prev) : (c + 1) * (d // prev)])
                new.extend(histories[c] + [child] for child in children)
            histories, prev = new, d
        seqs.extend(torch.cat(h) for h in histories)
    return Workload(
        name=name,
        seqs=seqs,
        description=(
            f"system {S} + {n_tasks} tasks x {group} rollouts: task {T}, {turns} turns of ~{L} tokens, "
            f"distinct histories per turn {tuple(distinct)}"
        ),
        params=dict(system_len=S, n_tasks=n_tasks, group=group, task_len=T, turns=turns, turn_len=L,
                    distinct=tuple(distinct), scale=scale),
    )


def per_turn(episodes: int = 8, turns: int = 30, system_len: int = 2000, turn_len: int = 100, scale: float = 1.0,
             vocab_size: int = 4096, seed: int = 0) -> Workload:
    """Per-turn training rows of agent episodes (one row per turn, the conversation up to it): a system prompt shared
    by every episode, episodes that differ from their first turn on, `turns` turns each (lengths drawn uniformly
    from `[turn_len / 2, 3 turn_len / 2]`). The tree is the system prompt with one chain per episode, a sequence
    ending at every turn: the layout where a walk segment by segment takes one forward per turn.

    ```
    system ─┬─ turn 1 ─ turn 2 ─ ... ─ turn T      (episode 0: rows end after every turn)
            └─ turn 1 ─ turn 2 ─ ... ─ turn T      (episode 1)
    ```

    Args:
        episodes (`int`, *optional*, defaults to `8`): episodes (chains).
        turns (`int`, *optional*, defaults to `30`): turns per episode (rows per chain).
        system_len (`int`, *optional*, defaults to `2000`): system prompt tokens (before scaling).
        turn_len (`int`, *optional*, defaults to `100`): mean tokens per turn (before scaling).
        scale (`float`, *optional*, defaults to `1.0`): length multiplier.
        vocab_size (`int`, *optional*, defaults to `4096`): ids are drawn from `[3, vocab_size)`.
        seed (`int`, *optional*, defaults to `0`): RNG seed.
    """
    tok = _Tokens(vocab_size, seed)
    lengths = torch.Generator().manual_seed(seed + 1)
    S, L = _scaled(system_len, scale), _scaled(turn_len, scale)
    system = tok.run(S)
    seqs = []
    for first in tok.siblings([1] * episodes):
        history = [system, first]
        for _ in range(turns):
            n = int(torch.randint(max(1, L // 2), max(2, 3 * L // 2 + 1), (1,), generator=lengths))
            history.append(tok.run(n))
            seqs.append(torch.cat(history))
    return Workload(
        name=f"per-turn-{episodes}x{turns}",
        seqs=seqs,
        description=f"system {S} + {episodes} episodes x {turns} turns of ~{L} tokens, one row per turn",
        params=dict(episodes=episodes, turns=turns, system_len=S, turn_len=L, scale=scale),
    )


def multi_turn_3x(scale: float = 1.0, vocab_size: int = 4096, seed: int = 0) -> Workload:
    """A multi-turn batch with less sharing (about 3x): shorter system prompt, longer private turns."""
    return multi_turn(
        system_len=2000, n_tasks=2, group=8, task_len=200, turns=3, turn_len=400, distinct=(4, 8, 8),
        scale=scale, vocab_size=vocab_size, seed=seed, name="multiturn-3x",
    )


def no_sharing(n_sequences: int = 16, length: int = 1024, scale: float = 1.0, vocab_size: int = 4096,
               seed: int = 0) -> Workload:
    """`n_sequences` rollouts of `length` tokens that share nothing (compression 1.0)."""
    L = _scaled(length, scale)
    seqs = _Tokens(vocab_size, seed).siblings([L] * n_sequences)
    return Workload(
        name="no-sharing",
        seqs=seqs,
        description=f"{n_sequences} sequences of {L} tokens, distinct first tokens",
        params=dict(n_sequences=n_sequences, length=L, scale=scale),
    )


GRPO_GRID = ((256, 8, 1024), (1024, 16, 256), (4096, 8, 512))

SUITES = {
    # name -> (grpo scale, multi-turn scale, no-sharing (n, length)); see the module docstring
    "quick": dict(grpo_scale=0.25, multi_turn_scale=0.125, no_sharing=(8, 512)),
    "full": dict(grpo_scale=1.0, multi_turn_scale=1.0, no_sharing=(16, 2048)),
}


def suite(name: str = "quick", vocab_size: int = 4096, seed: int = 0) -> list[Workload]:
    """The benchmark's workloads: the GRPO grid, multi-turn 9x and 3x, and the no-sharing control."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose one of {sorted(SUITES)}")
    cfg = SUITES[name]
    out = [grpo(p, g, c, scale=cfg["grpo_scale"], vocab_size=vocab_size, seed=seed) for p, g, c in GRPO_GRID]
    out.append(multi_turn(scale=cfg["multi_turn_scale"], vocab_size=vocab_size, seed=seed))
    out.append(multi_turn_3x(scale=cfg["multi_turn_scale"], vocab_size=vocab_size, seed=seed))
    n, length = cfg["no_sharing"]
    out.append(no_sharing(n, length, vocab_size=vocab_size, seed=seed))
    return out


def by_name(workloads: list[Workload], names: list[str] | None) -> list[Workload]:
    """Select workloads by name (all when `names` is empty)."""
    if not names:
        return workloads
    known = {w.name: w for w in workloads}
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"unknown workload(s) {missing}; choose from {list(known)}")
    return [known[n] for n in names]


def tau2_airline(tasks: int = 1, group: int = 4, vocab_size: int = 151936, prefix_tokens: int | None = None,
                 max_turns: int | None = None, path=None) -> Workload:
    """Per-turn rows of the first `group` episodes of each of the first `tasks` tasks of the tau2 token file.

    Args:
        tasks (`int`, *optional*, defaults to `1`): tasks (of the file's, in order).
        group (`int`, *optional*, defaults to `4`): episodes per task (variants `0 .. group - 1`).
        vocab_size (`int`, *optional*, defaults to `151936`, Qwen3's): ids at or above it are folded into
            `[FIRST_ID, vocab_size)` (identical ids stay identical; distinct ones may then collide).
        prefix_tokens (`int`, *optional*): keep only the first `prefix_tokens` of the prefix every episode shares
            (system prompt and tools; the tree's shape below it is unchanged): the dry run's small sizes.
        max_turns (`int`, *optional*): only the first `max_turns` agent turns of each episode.
        path (*optional*): the token file (default `tau2.TOKEN_FILE`).
    """
    from .tau2 import TOKEN_FILE, read_token_file

    data = read_token_file(path or TOKEN_FILE)
    prefix = data["prefix"]
    keep = len(prefix) if prefix_tokens is None else min(prefix_tokens, len(prefix))
    order = list(dict.fromkeys(e["task"] for e in data["episodes"]))[:tasks]
    if len(order) < tasks:
        raise ValueError(f"the token file holds {len(order)} tasks, {tasks} asked for")
    seqs = []
    for task in order:
        episodes = [e for e in data["episodes"] if e["task"] == task][:group]
        if len(episodes) < group:
            raise ValueError(f"task {task} has {len(episodes)} episodes in the token file, {group} asked for")
        for e in episodes:
            ids = torch.tensor(prefix[:keep] + e["ids"], dtype=torch.long)
            for _start, end in e["turns"][:max_turns]:
                seqs.append(ids[: end - (len(prefix) - keep)])
    seqs = [torch.where(s < vocab_size, s, s % (vocab_size - FIRST_ID) + FIRST_ID) for s in seqs]
    return Workload(
        name="tau2-airline",
        seqs=seqs,
        description=f"tau2 airline, {tasks} task(s) x {group} episodes, per-turn rows ({len(seqs)}), shared prefix "
                    f"{keep} of {len(prefix)} tokens" + (f", first {max_turns} turns" if max_turns else ""),
        params=dict(tasks=tasks, group=group, prefix_tokens=keep, max_turns=max_turns, vocab_size=vocab_size),
    )

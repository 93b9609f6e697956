"""The tau2-bench agent workload of the benchmarks: real domains, gold-action episodes, a real BPE tokenizer.

Episodes are played in the real domain (`trl_dta.envs.tau2`: tau2's system prompt and tool schemas through TRL's
Qwen2.5 chat template, tool outputs from the real database, the scripted user, tau2's evaluator) by a scripted policy
that replays each task's gold actions. The `G` episodes of a task branch at several depths (bits of the variant):

```
bit 0: ask the user to confirm who they are first (a text turn, answered by the scripted user)
bit 1: look something up twice (the first gold call repeated) before the gold actions
bit 2: leave out the last gold action (typically the write: tau2's reward drops to 0)
```

Lengths are those of a real BPE tokenizer: litellm's bundled DeepSeek tokenizer (`deepseek_tokenizer.json`, a
dependency of tau2), with the chat template's special tokens added. For training on a small benchmark model the ids
are relabelled compactly ([`compact_ids`]): every distinct token id of the batch gets its own small id, so the prefix
trees (what DTA shares) are exactly those of the real tokenizer.

The GPU check needs no tau2 on its machine: `python -m benchmarks.workloads.tau2 --write` plays the episodes once here
and writes their token ids (the real BPE's, all below Qwen3's vocabulary of 151,936) with each agent turn's span to
`TOKEN_FILE` ([`write_token_file`]); `workloads.tau2_airline` reads it back.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

DOMAINS = ("airline", "retail", "telecom", "mock")
TOKEN_FILE = Path(__file__).parent / "data" / "tau2-airline.json.gz"
_CONFIRM = "Before we go on, could you please confirm your name and user id?"


def bpe_chat_tokenizer():
    """litellm's DeepSeek BPE tokenizer with TRL's Qwen2.5 chat template (`<|im_start|>`, `<|im_end|>` = eos)."""
    import importlib.util

    import trl
    from transformers import PreTrainedTokenizerFast

    litellm = importlib.util.find_spec("litellm")  # located, not imported (its import is slow)
    if litellm is None:
        raise ImportError('the tau2 workload needs litellm, a dependency of tau2: pip install "trl-dta[tau2]"')
    path = Path(litellm.submodule_search_locations[0]) / "litellm_core_utils" / "tokenizers" / "deepseek_tokenizer.json"
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                  "additional_special_tokens": ["<|im_start|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    return tokenizer


def _turn_ids(tokenizer, message) -> list[int]:
    if isinstance(message, str):
        text = message
    elif message.get("tool_calls"):
        text = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                        "arguments": c["function"]["arguments"]}) + "\n</tool_call>"
                         for c in message["tool_calls"])
    else:
        text = message["content"]
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def variant_script(domain, task, variant: int) -> list:
    """The scripted policy's turns in the `variant`-th episode of `task` (see the module docstring)."""
    gold = domain.gold_turns(task)
    calls, closing = gold[:-1], gold[-1]
    turns = []
    if variant & 1:
        turns.append(_CONFIRM)
    if variant & 2 and calls:
        turns.append(calls[0])
    turns += calls[:-1] if variant & 4 and calls else calls
    return turns + [closing]


def gold_episodes(domain, task_ids, group: int, tokenizer, max_turns: int = 40):
    """`group` episodes of every task (variants 0 .. group-1), task by task; variant 0 is the gold replay."""
    from trl_dta.envs.core.chat import ChatRenderer
    from trl_dta.envs.core.rollout import run_sessions
    from trl_dta.envs.tau2 import Tau2Session
    from trl_dta.generation import Generation

    renderer = ChatRenderer(tokenizer, domain.tool_schemas)
    episodes = []
    for task_id in task_ids:
        task = domain.task(task_id)
        for variant in range(group):
            session = Tau2Session(domain, task_id, renderer, max_turns=max_turns)
            script = iter(variant_script(domain, task, variant))

            def generate(prefixes, budgets, script=script):
                ids = _turn_ids(tokenizer, next(script, "Is there anything else I can help you with?"))
                return [Generation(ids[:budgets[0]], None)]

            episode = run_sessions([session], [task_id], generate, max_turn_tokens=10**6, max_tokens=10**7)[0][0]
            episode.messages, episode.end_reason, episode.reward = session.chat[2:], session.end_reason, \
                session.reward()
            episodes.append(episode)
    return episodes


def domain_task_ids(domain, tasks: int) -> list[str]:
    """The first `tasks` tasks of the domain that have gold actions of the agent (so the variants differ)."""
    chosen = [t.id for t in domain.tasks if any(a.requestor == "assistant" for a in
                                                 (t.evaluation_criteria.actions or []))]
    return chosen[:tasks]


def compact_ids(episodes, vocab_size: int, eos_id: int, new_eos: int = 2, reserved: int = 3):
    """Relabels every distinct token id of `episodes` to a small id (in place): `eos_id` -> `new_eos`, the others
    to `reserved, reserved + 1, ...` in order of first appearance. Raises if they do not fit in `vocab_size`."""
    mapping = {eos_id: new_eos}
    for episode in episodes:
        for token in episode.ids:
            if token not in mapping:
                mapping[token] = reserved + len(mapping) - 1
    if max(mapping.values()) >= vocab_size:
        raise ValueError(f"{len(mapping)} distinct tokens do not fit a vocabulary of {vocab_size}; use a larger "
                         "model shape.")
    for episode in episodes:
        episode.ids = [mapping[token] for token in episode.ids]
    return episodes


def workload_stats(domain_name: str, tasks: int, group: int, tokenizer=None) -> tuple[dict, list]:
    """Per-domain numbers: system-prompt tokens, turns per episode, compression per layout, gold-replay reward."""
    from trl_dta.envs import layout_sequences
    from trl_dta.envs.tau2 import Tau2Domain
    from trl_dta.tree import PrefixTree

    tokenizer = tokenizer or bpe_chat_tokenizer()
    domain = Tau2Domain(domain_name)
    task_ids = domain_task_ids(domain, tasks)
    episodes = gold_episodes(domain, task_ids, group, tokenizer)
    system = tokenizer.apply_chat_template([{"role": "system", "content": domain.system_prompt}],
                                           tools=domain.tool_schemas, tokenize=True, return_dict=False)
    stats = {"domain": domain_name, "tasks": len(task_ids), "group": group,
             "system_prompt_tokens": len(system),
             "policy_tokens": len(tokenizer(domain.policy, add_special_tokens=False)["input_ids"]),
             "turns_per_episode": sum(len(e.turns) for e in episodes) / len(episodes),
             "mean_episode_tokens": sum(len(e.ids) for e in episodes) / len(episodes),
             "gold_reward": sum(e.reward.reward for e in episodes[::group]) / len(task_ids),
             "variant_reward": sum(e.reward.reward for e in episodes) / len(episodes)}
    for layout in ("episode", "per_turn"):
        tree = PrefixTree.from_sequences(layout_sequences(episodes, layout))
        stats[f"{layout}_rows"] = tree.n_sequences
        stats[f"{layout}_tokens"] = tree.n_tokens
        stats[f"{layout}_compression"] = tree.compression_ratio
    return stats, episodes


def write_token_file(path: str | Path = TOKEN_FILE, domain_name: str = "airline", tasks: int = 8,
                     group: int = 4) -> dict:
    """Play `group` gold-action variants of the first `tasks` tasks (see [`gold_episodes`]) and write their token ids.

    The file (gzipped JSON) holds the prefix every episode shares (system prompt, tool schemas) once, then per
    episode its task, variant, reward, the ids after the prefix and the `[start, end)` span of each agent turn in the
    whole conversation. Returns the written dict.
    """
    from trl_dta.envs.tau2 import Tau2Domain

    tokenizer = bpe_chat_tokenizer()
    domain = Tau2Domain(domain_name)
    task_ids = domain_task_ids(domain, tasks)
    episodes = gold_episodes(domain, task_ids, group, tokenizer)
    shared = min(next((i for i, (a, b) in enumerate(zip(e.ids, episodes[0].ids)) if a != b), len(e.ids))
                 for e in episodes)
    data = {
        "domain": domain_name,
        "tokenizer": "litellm's deepseek_tokenizer.json with TRL's qwen2_5 chat template (bpe_chat_tokenizer)",
        "vocab_size": len(tokenizer),
        "command": f"python -m benchmarks.workloads.tau2 --write --domain {domain_name} --tasks {tasks} "
                   f"--group {group}",
        "prefix": episodes[0].ids[:shared],
        "episodes": [{"task": e.task_id, "variant": i % group, "reward": e.reward.reward, "ids": e.ids[shared:],
                      "turns": [[t.start, t.end] for t in e.turns]} for i, e in enumerate(episodes)],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(data, f, separators=(",", ":"))
    return data


def read_token_file(path: str | Path = TOKEN_FILE) -> dict:
    """The dict [`write_token_file`] wrote (no tau2 needed)."""
    with gzip.open(path, "rt") as f:
        return json.load(f)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Write the tau2 token-id file of the GPU check (needs trl-dta[tau2]).")
    p.add_argument("--write", action="store_true", required=True)
    p.add_argument("--domain", default="airline", choices=DOMAINS)
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--out", default=str(TOKEN_FILE))
    args = p.parse_args(argv)
    data = write_token_file(args.out, args.domain, args.tasks, args.group)
    n = sum(len(e["ids"]) for e in data["episodes"]) + len(data["prefix"])
    print(f"wrote {args.out}: {len(data['episodes'])} episodes, shared prefix {len(data['prefix'])} tokens, {n} ids")


if __name__ == "__main__":
    main()

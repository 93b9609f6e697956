"""Chat-template turns: how a tool-calling conversation becomes tokens, and how a generated turn becomes a message.

The real agent workloads (`trl_dta.envs.tau2`) speak the policy's chat template, as TRL's tool loop does: the prompt
is the template's rendering of the system prompt, the tool schemas and the first user message, each policy turn is
generated up to the template's end-of-turn token, and every environment answer (tool results, a user message) is
appended as the tokens the template adds for it, followed by the next assistant header:

```
<|im_start|>system ... tools ...<|im_end|> <|im_start|>user hi<|im_end|> <|im_start|>assistant     <- prompt
<tool_call>{"name": "get_user_details", "arguments": {...}}</tool_call><|im_end|>                 <- policy turn
<|im_start|>user <tool_response> {...} </tool_response><|im_end|> <|im_start|>assistant           <- suffix (masked)
```

The suffix of new messages is rendered the way TRL's `GRPOTrainer._get_tool_suffix_ids` renders it (a dummy
conversation with and without them, cut at the end-of-turn token), so the token sequences are the ones TRL's own loop
would build, and the template must be prefix-preserving. A turn is read back with TRL's `parse_response` (the
template's response schema, set by `add_response_schema`): text content and tool calls.

[`build_chat_tokenizer`] gives an offline tokenizer for this: byte level (any text), Qwen2's pipeline, and one of the
chat templates TRL ships under `trl/chat_templates/` (TRL recognises them by exact comparison).
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2Tokenizer

# TRL chat templates the offline tokenizer can carry: name -> (file under trl/chat_templates, special tokens).
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CHAT_TEMPLATES = {
    "qwen2_5": ("qwen2_5.jinja", _QWEN_SPECIALS, _QWEN_TOOL_TOKENS),
    "qwen3": ("qwen3.jinja", _QWEN_SPECIALS, _QWEN_TOOL_TOKENS + ("<think>", "</think>")),
}


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte-to-unicode table: printable bytes stand for themselves, the others map to chr(256 + k).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def build_chat_tokenizer(template: str = "qwen2_5", model_max_length: int = 32768) -> Qwen2Tokenizer:
    """A byte-level tokenizer carrying one of TRL's tool-calling chat templates, built offline.

    The vocabulary is the template's special tokens (`<|endoftext|>` = pad, `<|im_start|>`, `<|im_end|>` = eos and
    end of turn), its tool tokens (`<tool_call>`, ...) and the 256 bytes, with no merges: every text encodes (one
    token per UTF-8 byte) and decodes back unchanged. It is Qwen2's pipeline, so it survives `save_pretrained` and
    `AutoTokenizer`. Token counts are those of bytes, several times a real BPE's: use a real tokenizer for lengths.

    Args:
        template (`str`, *optional*, defaults to `"qwen2_5"`): one of `CHAT_TEMPLATES` (the file of that name in
            `trl/chat_templates/`).
        model_max_length (`int`, *optional*, defaults to `32768`): the tokenizer's length limit.

    Returns:
        [`~transformers.Qwen2Tokenizer`]: with `chat_template` set; about 265 tokens.
    """
    if template not in CHAT_TEMPLATES:
        raise ValueError(f"`template` must be one of {sorted(CHAT_TEMPLATES)}, got {template!r}.")
    import trl

    filename, specials, tool_tokens = CHAT_TEMPLATES[template]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in _bytes_to_unicode().values():
        vocab[char] = len(vocab)
    for token in tool_tokens:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, pad_token=specials[0], eos_token=specials[2],
                               bos_token=None, model_max_length=model_max_length, add_bos_token=False)
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials[1:2])})
    tokenizer.add_tokens(list(tool_tokens))
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / filename).read_text(encoding="utf-8")
    return tokenizer


class ChatRenderer:
    """Renders a tool-calling conversation with a tokenizer's chat template and reads generated turns back.

    Args:
        tokenizer: the policy's tokenizer, with a chat template TRL knows (see `trl.chat_template_utils`).
        tools (`list[dict]`): the tool schemas (OpenAI function format) shown in the system prompt.
    """

    def __init__(self, tokenizer, tools: list[dict]):
        from trl.chat_template_utils import add_response_schema, is_chat_template_prefix_preserving

        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; use a chat model's tokenizer, or "
                             "`trl_dta.envs.core.chat.build_chat_tokenizer()` offline.")
        if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema",
                                                                             None) is None:
            tokenizer = add_response_schema(tokenizer)
        if not is_chat_template_prefix_preserving(tokenizer):
            raise ValueError("the tokenizer's chat template is not prefix-preserving (it rewrites earlier turns), so "
                             "a conversation cannot grow token by token; use one of TRL's training templates "
                             "(`trl.chat_template_utils.get_training_chat_template`).")
        self.tokenizer = tokenizer
        self.tools = tools

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The prompt: `messages` (system, user, ...) with the tool schemas and the assistant header."""
        return list(self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))

    def suffix_ids(self, messages: list[dict]) -> list[int]:
        """The tokens that `messages` (tool results or a user message) add after an assistant turn, with the next
        assistant header; as TRL's `_get_tool_suffix_ids` computes them."""
        name = next((m.get("name") for m in messages if m.get("role") == "tool"), None) or "tool"
        dummy = [{"role": "user", "content": "dummy"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}]
        prefix = self.tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False)
        full = self.tokenizer.apply_chat_template(dummy + messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
        eos = [i for i, token in enumerate(prefix) if token == self.tokenizer.eos_token_id]
        if eos:
            prefix = prefix[:eos[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise ValueError("the chat template renders a conversation's start differently once messages follow.")
        return list(full[len(prefix):])

    def parse(self, ids: list[int], prefix: list[int] | None = None) -> dict:
        """A generated turn as a message: `{"role": "assistant", "content": str, "tool_calls": [...]}` (no
        `tool_calls` key when there are none). Malformed tool-call JSON comes back as content, as TRL reads it.

        Args:
            ids (`list[int]`): the turn, `(turn_len,)`, ending with the end-of-turn token (or cut short).
            prefix (`list[int]`, *optional*): the tokens before the turn (the new-style response parser of
                transformers >= 5.13 needs them to know where the assistant message starts).
        """
        from trl.chat_template_utils import parse_response

        try:
            message = parse_response(self.tokenizer, list(ids), prefix=prefix, tools=self.tools)
        except Exception:  # a turn the response schema cannot read: the text is what the agent said
            message = {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}
        message.setdefault("role", "assistant")
        if message.get("content") is None:
            message["content"] = ""
        return message


def ensure_tool_template(tokenizer):
    """`tokenizer` with a chat template that renders tool schemas and tool calls, set in place when it lacks one.

    A ChatML tokenizer (`<|im_start|>` and eos `<|im_end|>`) whose own template knows no tools, SmolLM2-Instruct's
    for instance, gets TRL's Qwen2.5 template (`trl/chat_templates/qwen2_5.jinja`): the same special tokens and,
    for system / user / assistant messages with a system prompt, the same rendering as its own; tools go to the system
    message as `<tools>` JSON, calls are `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, results
    `<tool_response>` in a user turn. A template that already mentions `tools` is kept.

    Raises:
        `ValueError`: no chat template that can carry tools, and not ChatML.
    """
    template = getattr(tokenizer, "chat_template", None) or ""
    if "tools" in template:
        return tokenizer
    if "<|im_start|>" in tokenizer.get_vocab() and tokenizer.eos_token == "<|im_end|>":
        import trl

        filename = CHAT_TEMPLATES["qwen2_5"][0]
        tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / filename).read_text(encoding="utf-8")
        return tokenizer
    raise ValueError("the tokenizer's chat template renders no tools and is not ChatML; set `tokenizer.chat_template` "
                     "to a tool-calling template TRL knows (`trl/chat_templates/`) before training on a tau2 domain.")

"""The stand-in's text protocol inside a chat model's template, for pretrained instruct models.

The embedded tiny model reads the stand-in as one plain text with `agent:` / `user:` / `tool:` labels
(`envs.retail.protocol`). A pretrained chat model (e.g. SmolLM2-135M-Instruct, `demos.pretrained`) was trained on its
chat template instead, so [`ChatTurns`] writes the same episode as chat messages: the policy document as the system
message, a one-episode demonstration of the protocol as earlier turns, the user's opening; every agent turn is one
assistant message, every answer a `tool` or `user` message, each rendered by the tokenizer's own template:

```
<|im_start|>system  <policy document> answer with one line ...<|im_end|>   <- shared by every episode
<|im_start|>user  hi, i ordered o5 by mistake ...<|im_end|>                 <- the demonstration (shared)
<|im_start|>assistant  call find-user first=ann last=lee zip=40213<|im_end|>
...
<|im_start|>user  hi, i want to return my clock. i am carla lee. ...<|im_end|>
<|im_start|>assistant                                                        <- prompt ends here
call find-user first=carla last=lee zip=16311<|im_end|>                      <- policy turn
<|im_start|>tool  user u12<|im_end|> <|im_start|>assistant                   <- reply (masked), next header
```

The turns themselves are the stand-in's (`say <message>` / `call <tool> key=value ...`, read by
`protocol.parse_turn`), so the environment, the rewards and the gold actions are unchanged. Why this format and not
the template's JSON tool calls: SmolLM2-135M-Instruct's own template has no tool calls, and greedily the 135M model
copies a demonstrated `call find-user first=... last=... zip=...` line (often with the wrong tool or values, which
is what RL then fixes) where it rarely closes a JSON `<tool_call>`.

A reply is the template's rendering of the new message after an assistant turn, computed as TRL's
`_get_tool_suffix_ids` computes it (a conversation with and without the message, cut after the turn's end-of-turn
token), so the episode's tokens are those of the whole conversation rendered at once.
"""

from __future__ import annotations

from .env import RetailDomain
from .protocol import AGENT, TOOL, USER

INSTRUCTION = ("answer with one line: say <message> to the user, or call <tool> key=value ... to use a tool.\n")
"""Appended to the policy document in the system message."""

DEMONSTRATION = (
    {"role": "user", "content": "hi, i ordered o5 by mistake, please cancel it. i am ann lee, my zip is 40213."},
    {"role": "assistant", "content": "call find-user first=ann last=lee zip=40213"},
    {"role": "tool", "content": "user u3"},
    {"role": "assistant", "content": "call get-order order=o5"},
    {"role": "tool", "content": "order o5: pending, ships to rome, items lamp 25, total 25, returned none"},
    {"role": "assistant", "content": "call cancel-order order=o5 reason=mistake"},
    {"role": "tool", "content": "order o5 cancelled, refund 25"},
    {"role": "assistant", "content": "say order o5 is cancelled, your refund is 25."},
    {"role": "user", "content": "thanks, that is all. (stop)"},
)
"""One made-up episode of the protocol (its user, order and values are not the domain's), shown before the task. It
follows the domain's own procedure, as every gold solution does: find the user, look the order up, then act."""

_ROLES = {USER: "user", TOOL: "tool", AGENT: "assistant"}


def chat_suffix_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The tokens that `messages` add after an assistant turn that ended with the end-of-turn token, with the next
    assistant header: the template's rendering of a dummy conversation with and without them, cut after the turn's
    end-of-turn token (TRL's `GRPOTrainer._get_tool_suffix_ids` does the same for tool messages).

    Args:
        tokenizer: a tokenizer with a chat template whose `eos_token` ends an assistant turn.
        messages (`list[dict]`): the new messages (`role`, `content`).

    Returns:
        `list[int]`: the suffix, `(n_tokens,)`.
    """
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
    prefix = list(tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False))
    full = list(tokenizer.apply_chat_template(dummy + list(messages), add_generation_prompt=True, tokenize=True,
                                              return_dict=False))
    eos = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if not eos:
        raise ValueError(f"the chat template does not end an assistant turn with the eos token "
                         f"{tokenizer.eos_token!r}; set `tokenizer.eos_token` to the template's end-of-turn token.")
    prefix = prefix[:eos[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template renders a conversation's start differently once messages follow (it is "
                         "not prefix-preserving), so an episode cannot grow turn by turn.")
    return full[len(prefix):]


class ChatTurns:
    """The stand-in's episodes as chat messages in a tokenizer's template (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer, with a chat template whose `eos_token` ends an assistant turn.
        domain ([`~envs.retail.env.RetailDomain`]): the domain.
        demonstration (`bool`, *optional*, defaults to `True`): show [`DEMONSTRATION`] before the task.
    """

    def __init__(self, tokenizer, domain: RetailDomain, demonstration: bool = True):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("ChatTurns needs a tokenizer with a chat template (a chat model's); the embedded tiny "
                             "model plays the plain-text protocol instead (`AgentRolloutFunc(chat=False)`).")
        self.tokenizer, self.domain = tokenizer, domain
        self.system = domain.system_prompt + INSTRUCTION
        self.demonstration = list(DEMONSTRATION) if demonstration else []
        chat_suffix_ids(tokenizer, [{"role": "tool", "content": "x"}])  # refuses a template that cannot grow

    def messages(self, task_id: int) -> list[dict]:
        """The episode's prompt as messages: system (policy and instruction), the demonstration, the opening."""
        return [{"role": "system", "content": self.system}, *self.demonstration,
                {"role": "user", "content": self.domain.task(task_id).opening}]

    def prompt_ids(self, task_id: int) -> list[int]:
        """The prompt's tokens, ending with the assistant header, `(n_tokens,)`."""
        return list(self.tokenizer.apply_chat_template(self.messages(task_id), add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))

    def reply_ids(self, role: str, text: str) -> list[int]:
        """The tokens of one environment answer (`role` = `"user"` or `"tool"`) after an agent turn, with the next
        assistant header."""
        return chat_suffix_ids(self.tokenizer, [{"role": _ROLES[role], "content": text}])

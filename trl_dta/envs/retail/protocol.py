"""The plain-text turn protocol: how a conversation is written down, and how an agent turn is read.

A conversation is one text, a role label before every message. The prompt holds the policy document, a ticket line
(the task id, so that a prompt names its task) and the user's opening; every later message from the environment ends
with the `agent: ` header that invites the next agent turn:

```
<policy document>
ticket 17
user: hi, i want to cancel an order.
agent: call find-user first=ann last=lee zip=40213<eos>       <- agent turn: the policy's tokens
tool: user u1                                                  <- environment reply, masked out of the loss
agent: say which order?<eos>
user: the order is o2.
agent: ...
```

An agent turn is one line (surrounding whitespace ignored), either

- `say <message>`: a message to the user, answered by the user simulator, or
- `call <tool> key=value ...`: a tool call, answered by the tool (values have no spaces).

Anything else is answered with an `error: ...` tool message and the episode goes on. The turn ends where the policy
emits its end-of-turn token (the tokenizer's eos) or runs out of turn budget; the token itself is not part of the text.
Every label and marker is lowercase ASCII over the tiny tokenizer's alphabet.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.credits import common_prefix
from .database import TOOLS

AGENT, USER, TOOL = "agent", "user", "tool"
SAY, CALL = "say", "call"
_KEYWORDS = (f"{SAY} ", f"{CALL} ")


@dataclass(frozen=True)
class Say:
    """An agent message to the user."""

    text: str

    def render(self) -> str:
        return f"{SAY} {self.text}"


@dataclass(frozen=True)
class Call:
    """A tool call. `args` is sorted by name, so two calls with the same arguments compare equal in any order."""

    tool: str
    args: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, tool: str, **args: str) -> Call:
        return cls(tool, tuple(sorted(args.items())))

    @property
    def kwargs(self) -> dict[str, str]:
        return dict(self.args)

    def render(self) -> str:
        return " ".join([CALL, self.tool, *(f"{key}={value}" for key, value in self.args)])


class ProtocolError(ValueError):
    """A malformed agent turn; its message (starting with `error:`) is the environment's answer."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


def parse_turn(text: str) -> Say | Call:
    """Reads one agent turn.

    Args:
        text (`str`): the turn as decoded (without the end-of-turn token).

    Returns:
        [`Say`] or [`Call`]. Raises [`ProtocolError`] for an empty turn, several lines, an unknown keyword, an empty
        message, a call without a tool, an argument that is not `key=value` or a repeated argument. Whether the tool
        exists and takes these arguments is the tool's business (`database.run_tool`).
    """
    line = text.strip()
    if not line:
        raise ProtocolError("empty turn.")
    if "\n" in line:
        raise ProtocolError("one line per turn.")
    keyword, _, rest = line.partition(" ")
    rest = rest.strip()
    if keyword == SAY:
        if not rest:
            raise ProtocolError("say needs a message.")
        return Say(" ".join(rest.split()))
    if keyword != CALL:
        raise ProtocolError("start with say or call.")
    words = rest.split()
    if not words:
        raise ProtocolError("call needs a tool name.")
    args: dict[str, str] = {}
    for word in words[1:]:
        key, sign, value = word.partition("=")
        if not (key and sign and value):
            raise ProtocolError(f"arguments are key=value, got {word}.")
        if key in args:
            raise ProtocolError(f"argument {key} given twice.")
        args[key] = value
    return Call.of(words[0], **args)


def named_tool(text: str) -> str | None:
    """The tool a one-line `call` turn names, whether or not its arguments parse (`call get-order order=o2, thanks`
    names `get-order`); `None` for any other turn. The shaped tool credit reads it (`envs.core.credits.tool_credit`):
    the right tool is credited on its own, the arguments and the form by their own credits."""
    line = text.strip()
    keyword, _, rest = line.partition(" ")
    words = rest.split()
    return words[0] if keyword == CALL and words and "\n" not in line else None


def protocol_score(text: str) -> float:
    """How well one agent turn follows the protocol, in `[0, 1]`; `1.0` for every well-formed action.

    The score adds

    - `0.5 * lcp / len(keyword)`: the longest prefix the stripped turn shares with `"say "` or `"call "`, so that the
      first right character already counts;
    - for a parsed `say`: `0.5`; for a parsed `call`: `0.25` if the tool exists, `0.25` more if its argument names
      are exactly the tool's parameters.

    Args:
        text (`str`): the turn as decoded.

    Returns:
        `float`: the score.
    """
    line = text.strip()
    prefix = max(common_prefix(line, keyword) / len(keyword) for keyword in _KEYWORDS)
    try:
        action = parse_turn(text)
    except ProtocolError:
        return 0.5 * prefix
    if isinstance(action, Say):
        return 1.0
    spec = TOOLS.get(action.tool)
    if spec is None:
        return 0.5
    return 1.0 if set(action.kwargs) == set(spec.params) else 0.75


def call_format_score(text: str) -> float:
    """How well-formed a *tool call* one agent turn is, in `[0, 1]` (the shaped `format_reward`): `0.5 * lcp / 5` for
    the share of `"call "` it starts with when it does not parse, `0.25` for a well-formed `say` (a turn, not a call),
    `0.5` for a call of an unknown tool, `0.75` of a known one, `1.0` with exactly the tool's parameter names."""
    line = text.strip()
    try:
        action = parse_turn(text)
    except ProtocolError:
        return 0.5 * common_prefix(line, f"{CALL} ") / len(f"{CALL} ")
    if isinstance(action, Say):
        return 0.25
    spec = TOOLS.get(action.tool)
    if spec is None:
        return 0.5
    return 1.0 if set(action.kwargs) == set(spec.params) else 0.75


def protocol_tokenizer():
    """The tiny character-level tokenizer (`demos.tiny.build_tokenizer`) with the protocol's words as single tokens:
    `say `, `call ` and the six tool names, as a chat model's tokenizer has its tool-call tokens. A random model then
    starts a well-formed turn with one right token instead of four or five right characters in a row, which the
    agent recipe's shaped rewards can teach a tiny model within a few minutes; every other text is still spelled
    character by character, and `decode(encode(text)) == text`."""
    from ...demos.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_tokens([f"{SAY} ", f"{CALL} ", *TOOLS])
    return tokenizer


def render_prompt(system_prompt: str, task_id: int, opening: str) -> str:
    """The episode's prompt: policy document, ticket line, the user's opening and the first agent header."""
    return f"{system_prompt}ticket {task_id}\n{USER}: {opening}\n{AGENT}: "


def render_reply(role: str, text: str) -> str:
    """An environment message after an agent turn: on a new line, with its role label and the next agent header."""
    return f"\n{role}: {text}\n{AGENT}: "

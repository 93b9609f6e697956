"""The turn protocol: parsing, error messages, the protocol score and the rendering of a conversation."""

from __future__ import annotations

import pytest

from trl_dta.envs.retail.protocol import (
    Call,
    ProtocolError,
    Say,
    parse_turn,
    protocol_score,
    render_prompt,
    render_reply,
)


@pytest.mark.parametrize(
    "text,action",
    [
        ("say hello there", Say("hello there")),
        ("  say   hello    there \n", Say("hello there")),
        ("call get-order order=o4", Call.of("get-order", order="o4")),
        ("call find-user zip=00123 first=ann last=lee", Call.of("find-user", first="ann", last="lee", zip="00123")),
        ("call unknown-tool", Call("unknown-tool", ())),
    ],
)
def test_parse(text, action):
    assert parse_turn(text) == action


def test_call_arguments_compare_in_any_order():
    assert parse_turn("call x a=1 b=2") == parse_turn("call x b=2 a=1")
    assert Call.of("x", b="2", a="1").render() == "call x a=1 b=2"
    assert parse_turn(Call.of("cancel-order", order="o1", reason="mistake").render()).kwargs == {
        "order": "o1", "reason": "mistake"}


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "error: empty turn."),
        ("   \n ", "error: empty turn."),
        ("say hi\ncall get-user user=u1", "error: one line per turn."),
        ("hello", "error: start with say or call."),
        ("sayhi", "error: start with say or call."),
        ("say", "error: say needs a message."),
        ("call", "error: call needs a tool name."),
        ("call get-order o4", "error: arguments are key=value, got o4."),
        ("call get-order order=", "error: arguments are key=value, got order=."),
        ("call get-order =o4", "error: arguments are key=value, got =o4."),
        ("call get-order order=o4 order=o5", "error: argument order given twice."),
    ],
)
def test_malformed_turns(text, message):
    with pytest.raises(ProtocolError) as error:
        parse_turn(text)
    assert str(error.value) == message


@pytest.mark.parametrize(
    "text,score",
    [
        ("say hi", 1.0),
        ("call get-order order=o4", 1.0),
        ("call get-order user=u4", 0.75),  # known tool, wrong argument names
        ("call get-order", 0.75),
        ("call no-such-tool a=b", 0.5),  # well-formed call of an unknown tool
        ("say", 0.5 * 3 / 4),  # keyword only, no message
        ("s", 0.5 * 1 / 4),
        ("  ca", 0.5 * 2 / 5),
        ("call get-order o4", 0.5),  # keyword right, arguments malformed
        ("xyz", 0.0),
        ("", 0.0),
    ],
)
def test_protocol_score(text, score):
    assert protocol_score(text) == pytest.approx(score, abs=1e-12)


def test_rendering():
    assert render_prompt("policy\n", 7, "hi.") == "policy\nticket 7\nuser: hi.\nagent: "
    assert render_reply("tool", "user u1") == "\ntool: user u1\nagent: "

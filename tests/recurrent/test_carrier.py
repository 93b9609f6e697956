"""`StateCarrier`, the cache a hybrid model's layers see in a DTA forward: the conv-state tail it hands on (a segment
shorter than the kernel included), its refusals, and the layout it reads from the config."""

from __future__ import annotations

import pytest
import torch

from hybrid_models import HYBRID_FAMILIES, VOCAB
from trl_dta.modeling.families import RECURRENT_FAMILIES
from trl_dta.recurrent import LayerLayout, StateCarrier
from trl_dta.refusal import DTAUnsupportedError

K = 4  # conv kernel


LAYOUT = LayerLayout(2, (1,), (0,))


def _carrier(path_states=None, batch=1, length=3, layout=LAYOUT):
    return StateCarrier(layout, lambda layer: path_states, batch, length, path_length=5)


@pytest.mark.parametrize("lengths", [[1], [2, 1], [1, 1, 1, 1, 1], [3, 2], [6], [2, 5, 1]])
def test_conv_tail_is_the_last_kernel_inputs_of_the_whole_path(lengths):
    """Feeding a sequence segment by segment, each continuing from the tail the previous one recorded: the
    concatenation a layer convolves ends with exactly the dense sequence's inputs, and each tail is the last `k - 1`
    inputs of the path so far, zeros standing for the positions before the first (a segment shorter than the kernel
    reaches into its grandparents)."""
    x = torch.randn(1, 5, sum(lengths), dtype=torch.float64)  # (batch, channels, tokens)
    state, start = None, 0
    for n in lengths:
        carrier = _carrier(None if state is None else (state, None), length=max(n, 2))
        full = carrier.update_conv_state(x[..., start : start + n], 0, conv_kernel_size=K)
        path = torch.nn.functional.pad(x[..., : start + n], (K - 1, 0))  # zeros before the first token
        assert torch.equal(full[..., -(start + n if state is None else K - 1 + n):], path[..., -full.shape[-1]:])
        start += n
        state = carrier.conv[0]
        assert state.shape == (1, 5, K - 1) and torch.equal(state, path[..., -(K - 1):])


def test_states_are_broadcast_to_the_rows_and_attention_passes_through():
    conv, rec = torch.randn(1, 5, K - 1), torch.randn(1, 2, 3, 4)
    carrier = _carrier((conv, rec), batch=3)
    assert carrier.get_recurrent_state(0).shape == (3, 2, 3, 4)
    assert carrier.get_recurrent_state(0).data_ptr() == rec.data_ptr()  # expanded, not copied
    assert carrier.update_conv_state(torch.randn(3, 5, 3), 0, conv_kernel_size=K).shape == (3, 5, K - 1 + 3)
    k, v = torch.randn(3, 2, 3, 8), torch.randn(3, 2, 3, 8)
    assert carrier.update(k, v, 1) == (k, v)
    assert carrier.is_recording_past(0) and carrier.get_seq_length() == 5
    assert _carrier(None).get_conv_state(0) is None and _carrier(None).get_recurrent_state(0) is None


def test_refusals():
    state = (torch.randn(1, 5, K - 1), torch.randn(1, 2, 3, 4))
    with pytest.raises(RuntimeError, match="one-token forward with a path state"):
        _carrier(state, length=1).get_recurrent_state(0)
    with pytest.raises(DTAUnsupportedError, match="several states"):
        _carrier(state).get_conv_state(0, state_idx=1)
    with pytest.raises(DTAUnsupportedError, match="without `conv_kernel_size`"):
        _carrier(state).update_conv_state(torch.randn(1, 5, 3), 0)
    carrier = _carrier(None)
    with pytest.raises(DTAUnsupportedError, match=r"recurrent layers \[0\].*from layers \[\]"):
        carrier.states()
    carrier.update_recurrent_state(torch.randn(1, 2, 3, 4), 0)
    assert carrier.states()[1] is None and carrier.states()[0][1].shape == (1, 2, 3, 4)


@pytest.mark.parametrize("family", sorted(HYBRID_FAMILIES))
def test_layout_of_each_family(family):
    config = HYBRID_FAMILIES[family](VOCAB)
    layout = LayerLayout.from_config(config)
    assert config.model_type in RECURRENT_FAMILIES and layout.hybrid
    expected = {"nemotron_h": ((1,), (0, 2)), "falcon_h1": ((0, 1), (0, 1))}.get(family, ((1, 3), (0, 2)))
    assert (layout.attention, layout.recurrent) == expected


def test_layout_without_layer_types_is_all_attention():
    class Config:
        num_hidden_layers = 3

    assert LayerLayout.from_config(Config()) == LayerLayout(3, (0, 1, 2), ())

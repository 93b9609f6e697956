"""The dispatch table of `trl_dta.parallel`: every distributed type accelerate knows has an entry (a strategy or a
refusal naming the alternative), and one process gets the no-op strategy. The strategies themselves run under real
`accelerate launch`es in `tests/trainers/test_sharded.py` and `test_distributed.py`."""

from __future__ import annotations

import pytest
from accelerate import Accelerator
from accelerate.utils import DistributedType

from trl_dta.parallel import STRATEGIES, Local, strategy_for
from trl_dta.parallel.zero import _offloaded
from trl_dta.refusal import DTAUnsupportedError


def test_every_accelerate_distributed_type_has_an_entry():
    assert set(DistributedType.__members__) <= set(STRATEGIES), set(DistributedType.__members__) - set(STRATEGIES)


@pytest.mark.parametrize("kind", ["MEGATRON_LM", "XLA"])
def test_refused_kinds_name_the_alternative(kind):
    with pytest.raises(DTAUnsupportedError, match="not supported with DTA.*FSDP2|not supported with DTA.*DDP"):
        STRATEGIES[kind](None, None)


def test_one_process_is_local():
    accelerator = Accelerator(cpu=True)
    strategy = strategy_for(accelerator)
    assert type(strategy) is Local and strategy.backward_scale(accelerator) == 1.0


def test_zero_offload_read_from_the_deepspeed_config():
    assert _offloaded({"zero_optimization": {"stage": 2}}) == []
    assert _offloaded({"zero_optimization": {"offload_optimizer": {"device": "none"}}}) == []
    assert _offloaded({"zero_optimization": {"offload_optimizer": {"device": "cpu"},
                                             "offload_param": {"device": "nvme"}}}) == ["offload_optimizer",
                                                                                         "offload_param"]

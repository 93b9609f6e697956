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


def test_zero3_budget_reads_the_gathered_footprint():
    """ZeRO-3's schedule choice (`dta_zero3_gather_budget_mb`): the model's parameters and trainable gradients gathered
    whole, `P b_p + P_t b_g`, at the dtype DeepSpeed casts the module to."""
    import torch

    from trl_dta.parallel.zero3 import gathered_megabytes

    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))
    model[1].requires_grad_(False)
    trainable, frozen = 256 * 1024 + 1024, 1024 * 256 + 256
    assert gathered_megabytes(model, bits16=False) == (2 * trainable + frozen) * 4 / 2**20
    assert gathered_megabytes(model, bits16=True) == (2 * trainable + frozen) * 2 / 2**20


@pytest.mark.parametrize("value", [-1.0, float("nan"), "64"])
def test_zero3_budget_is_checked(value):
    from trl_dta import DTAGRPOConfig

    with pytest.raises((TypeError, ValueError), match="dta_zero3_gather_budget_mb"):
        DTAGRPOConfig(output_dir="out", dta_zero3_gather_budget_mb=value, use_cpu=True, report_to="none")

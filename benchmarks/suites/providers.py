"""The methods the engine benchmarks measure, behind one interface ([`PROVIDERS`]: method name -> provider factory).

```python
provider = PROVIDERS[method](model, MethodConfig())
out = provider.forward_backward(seqs, loss_fn)  # adds d(sum_i loss_fn(i, logps_i, entropy_i))/d(theta) to .grad
```

with `loss_fn(i, logps_i, entropy_i)` the per-sequence loss of [`~trl_dta.DTAEngine.forward_backward`]. The peers
live in `benchmarks/baselines/` (`dense`: TRL's padded micro-batches; `sparse`: the packed tree under a tree mask;
`trl-tree`: TRL's own tree packing); `dta` is [`DTAProvider`]. [`accounting`] says what a method's step ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..baselines.dense import DenseProvider, ProviderOutput
from ..baselines.sparse import SparseProvider
from ..baselines.trl_tree import TRLTreeProvider


class DTAProvider:
    """`DTAEngine.forward_backward` behind the providers' interface.

    Args:
        model ([`~transformers.PreTrainedModel`]): the policy.
        **engine_kwargs: passed to [`~trl_dta.DTAEngine`] (`max_batch_tokens`, `max_graph_tokens`, `block_size`).
    """

    def __init__(self, model, **engine_kwargs):
        from trl_dta import DTAEngine

        self.engine = DTAEngine(model, **engine_kwargs)

    def forward_backward(self, seqs, loss_fn: Callable) -> ProviderOutput:
        out = self.engine.forward_backward(seqs, loss_fn)
        return ProviderOutput(loss=float(out.loss), logps=out.logps, stats=dict(out.stats))


@dataclass
class MethodConfig:
    """Knobs of the providers (the same for every workload of a run).

    Args:
        micro_batch_size (`int`): rows per micro-batch of `dense` and `dense+ckpt` (`dense-mb8` runs
            `TRL_MICRO_BATCH_SIZE`).
        sparse_attention (`str`): `"blocks"` or `"mask"`: the attention of the method `sparse` (see
            `baselines/sparse.py`; `sparse-flex` and `sparse-blocks` name theirs).
        sparse_max_tokens (`int`, *optional*): tree tokens per packed micro-batch (None: the whole tree in one row).
        trl_token_budget (`int`, *optional*): TRL's `token_budget` of `trl-tree` (None: the whole batch in one row).
        dta_max_batch_tokens (`int`): DTA sibling-batch budget (padded tokens per forward).
        dta_max_graph_tokens (`int`, *optional*): DTA kept-graph budget (None = keep every graph) for `dta`;
            `dta-lowmem` uses `dta_lowmem_graph_tokens`.
        dta_attn_backend (`str`): attention backend of `dta` and `dta-lowmem` (`"auto"`: the engine's default).
    """

    micro_batch_size: int = field(default=1, metadata={"help": "Rows per micro-batch of `dense` and `dense+ckpt`."})
    sparse_attention: str = field(default="blocks", metadata={"help": "'blocks' or 'mask'."})
    sparse_max_tokens: int | None = field(default=None, metadata={
        "help": "Tree tokens per packed micro-batch (None: the whole tree, one row)."})
    trl_token_budget: int | None = field(default=None, metadata={
        "help": "TRL's token_budget for `trl-tree` (None: the whole batch, one row)."})
    dta_max_batch_tokens: int = field(default=8192, metadata={"help": "DTA sibling-batch budget."})
    dta_max_graph_tokens: int | None = field(default=None, metadata={"help": "DTA kept-graph budget for `dta`."})
    dta_lowmem_graph_tokens: int = field(default=1024, metadata={"help": "Kept-graph budget of `dta-lowmem`."})
    dta_block_size: int = field(default=1024, metadata={"help": "DTA recompute block."})
    dta_max_pack_tokens: int | None = field(
        default=None, metadata={"help": "DTA packed-subtree budget (None: the engine's default)."}
    )
    dta_attn_backend: str = field(default="auto", metadata={
        "help": "Attention backend of `dta` and `dta-lowmem` (`dta-<backend>` methods name theirs)."})

    def engine_kwargs(self, max_graph_tokens: int | None, attn_backend: str | None = None) -> dict:
        kwargs = dict(max_batch_tokens=self.dta_max_batch_tokens, max_graph_tokens=max_graph_tokens,
                      block_size=self.dta_block_size, attn_backend=attn_backend or self.dta_attn_backend)
        if self.dta_max_pack_tokens is not None:
            kwargs["max_pack_tokens"] = self.dta_max_pack_tokens
        return kwargs


# TRL's default micro-batch: `GRPOConfig.per_device_train_batch_size` (inherited from `TrainingArguments`, 8 in
# transformers 5.x), padded rows run together: what a user who keeps TRL's defaults gets (checkpointing aside).
TRL_MICRO_BATCH_SIZE = 8

PROVIDERS: dict[str, Callable] = {
    "dense": lambda model, cfg: DenseProvider(model, micro_batch_size=cfg.micro_batch_size),
    "dense-mb8": lambda model, cfg: DenseProvider(model, micro_batch_size=TRL_MICRO_BATCH_SIZE),
    "dense+ckpt": lambda model, cfg: DenseProvider(model, micro_batch_size=cfg.micro_batch_size,
                                                   gradient_checkpointing=True),
    # TRL's default dense path: its micro-batch and gradient checkpointing (`GRPOConfig.gradient_checkpointing=True`)
    "dense-ckpt": lambda model, cfg: DenseProvider(model, micro_batch_size=TRL_MICRO_BATCH_SIZE,
                                                   gradient_checkpointing=True),
    "sparse": lambda model, cfg: SparseProvider(model, attention=cfg.sparse_attention,
                                                max_tokens=cfg.sparse_max_tokens),
    # the packed tree under torch's FlexAttention and a block mask of the ancestor test; on CPU training
    # takes the block loop (torch has no CPU FlexAttention backward), said in the row's `attention`
    "sparse-flex": lambda model, cfg: SparseProvider(model, attention="flex", max_tokens=cfg.sparse_max_tokens),
    "sparse-blocks": lambda model, cfg: SparseProvider(model, attention="blocks", max_tokens=cfg.sparse_max_tokens),
    # TRL's own tree packing (AsyncGRPOTrainer: TreeRow, its planner, tree_attention's signature)
    "trl-tree": lambda model, cfg: TRLTreeProvider(model, token_budget=cfg.trl_token_budget),
    "dta": lambda model, cfg: DTAProvider(model, **cfg.engine_kwargs(cfg.dta_max_graph_tokens)),
    "dta-lowmem": lambda model, cfg: DTAProvider(model, **cfg.engine_kwargs(cfg.dta_lowmem_graph_tokens)),
}
# `dta` on one named attention backend (`dta-sdpa`: the concatenating reference, one copy of the path per sibling).
ATTN_BACKENDS = ("sdpa", "torch", "flash", "triton")
PROVIDERS.update({
    f"dta-{name}": (lambda name: lambda model, cfg: DTAProvider(
        model, **cfg.engine_kwargs(cfg.dta_max_graph_tokens, attn_backend=name)))(name)
    for name in ATTN_BACKENDS
})


def accounting(provider, stats: dict, n_rows: int) -> dict:
    """What a method's step ran: `micro_batches`, `forwards` (model calls, each a forward and its backward),
    `forward_tokens` (dense: its padded rows; DTA: its real tokens, recomputed ones included) and `padded_tokens`
    (what the model computed, padding included), and the attention it ran."""
    if isinstance(provider, DenseProvider):
        batches = -(-n_rows // provider.micro_batch_size)
        return dict(micro_batches=batches, forwards=batches, forward_tokens=stats.get("padded_tokens"),
                    padded_tokens=stats.get("padded_tokens"), attention=stats.get("attention"))
    batches = stats.get("micro_batches", 1)  # DTA: one walk of the whole tree
    real = stats.get("forward_tokens", 0) + stats.get("recomputed_tokens", 0)
    return dict(micro_batches=batches, forwards=stats.get("forwards", batches), forward_tokens=real,
                padded_tokens=stats.get("padded_tokens", real), attention=stats.get("attention"))

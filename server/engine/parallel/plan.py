"""Which part of the model each rank of a sharded worker holds.

Ranks are numbered stage-major: `rank = stage * tp_size + tp_rank`. Rank 0 is the driver (the engine thread of
the worker: it schedules, samples and talks to the KVBM index); every rank computes.

    tensor parallel (tp_size t): attention heads and KV heads split in t contiguous ranges (each rank holds its
        heads' part of every KV block), qkv and gate/up split by output rows (column-parallel), o_proj and down
        by input columns (row-parallel, one all-reduce each), lm_head by vocabulary rows (each rank computes its
        slice of the logits, the driver gathers them); the embedding and the norms are replicated
    pipeline parallel (pp_size p): contiguous layer ranges, the first `num_layers % p` stages one layer longer;
        the first stage embeds, the last one computes the logits; a stage hands its residual stream to the next
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.engine.model import ModelShape


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """One rank's part of a model: tensor slice `tp_rank` of `tp_size`, layers `layers` of pipeline stage
    `stage` of `pp_size`."""

    tp_size: int
    pp_size: int
    rank: int
    num_layers: int  # of the whole model

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    @property
    def layers(self) -> range:
        return stage_layers(self.num_layers, self.pp_size, self.stage)

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks of pipeline stage `stage`, tp_rank order."""
        return [stage * self.tp_size + r for r in range(self.tp_size)]

    def peer(self, stage: int) -> int:
        """The rank of `stage` with this rank's tp_rank: where a stage sends its hidden state (each TP rank of a
        stage holds the whole residual stream after its all-reduce)."""
        return stage * self.tp_size + self.tp_rank

    @property
    def tag(self) -> str:
        """The KV layout suffix of this rank's part of every block: tiers never mix parts of different plans."""
        return f"|tp{self.tp_size}r{self.tp_rank}|pp{self.pp_size}s{self.stage}"


def stage_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """Contiguous layers of `stage`: the first `num_layers % pp_size` stages get one more."""
    base, extra = divmod(num_layers, pp_size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def vocab_slice(vocab_size: int, tp_size: int, tp_rank: int) -> range:
    """The vocabulary rows of lm_head that `tp_rank` computes (contiguous; the first ranks one row longer)."""
    return stage_layers(vocab_size, tp_size, tp_rank)


def local_shape(shape: ModelShape, plan: ShardPlan) -> ModelShape:
    """The shape of one rank's part: its heads, KV heads, intermediate columns and layers."""
    t = plan.tp_size
    return dataclasses.replace(
        shape,
        num_heads=shape.num_heads // t,
        num_kv_heads=shape.num_kv_heads // t,
        intermediate_size=shape.intermediate_size // t,
        num_layers=len(plan.layers),
    )


def check_shardable(shape: ModelShape, tp_size: int, pp_size: int) -> None:
    """ValueError naming the dimension, its size and the parallel size that does not divide it."""
    for name, size in (
        ("num_attention_heads", shape.num_heads),
        ("num_key_value_heads", shape.num_kv_heads),
        ("intermediate_size", shape.intermediate_size),
    ):
        if size % tp_size:
            raise ValueError(
                f"tensor_parallel_size {tp_size} does not divide the model's {name} ({size}): "
                f"choose a tensor_parallel_size that divides {name}"
            )
    if pp_size > shape.num_layers:
        raise ValueError(
            f"pipeline_parallel_size {pp_size} is more than the model's num_hidden_layers ({shape.num_layers})"
        )


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))

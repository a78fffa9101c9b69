"""The pure-Python core: sequences, block pool with prefix cache, scheduler, batch plans.

Nothing here imports torch, numpy or triton; a custom runtime can drive :class:`Scheduler`
with any executor that can run a :class:`BatchPlan`.
"""

from pagedinfer.domain.block_pool import Block, BlockPool, PoolStats, cdiv
from pagedinfer.domain.decode_batch import DecodeBatch
from pagedinfer.domain.hashing import block_hash, chain_hashes, extend_chain
from pagedinfer.domain.plan import (
    BLOCK_TABLE_FILLER,
    PADDING_SLOT,
    BatchPlan,
    NewRequest,
    ScheduledChunk,
    build_batch_plan,
    mixed_batch_plan,
)
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from pagedinfer.domain.sequence import FinishReason, Sequence, SequenceStatus
from pagedinfer.domain.structured import StructuredOutputsParams

__all__ = [
    "BLOCK_TABLE_FILLER",
    "PADDING_SLOT",
    "BatchPlan",
    "Block",
    "BlockPool",
    "DecodeBatch",
    "FinishReason",
    "NewRequest",
    "PoolStats",
    "SamplingParams",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
    "StructuredOutputsParams",
    "block_hash",
    "build_batch_plan",
    "cdiv",
    "chain_hashes",
    "extend_chain",
    "mixed_batch_plan",
]

"""The pure-Python core: sequences, block pool with prefix cache, scheduler, batch plans.

Nothing here imports torch, numpy or triton (``pip install .``, the core install, installs
this and xxhash only); a custom runtime can drive :class:`Scheduler` with any :class:`Executor` that
can run a :class:`BatchPlan`. The executor contract: :mod:`pagedinfer.domain.executor`.
"""

from pagedinfer.domain.block_pool import Block, BlockPool, PoolStats, cdiv
from pagedinfer.domain.decode_batch import DecodeBatch
from pagedinfer.domain.events import (
    PrefixCacheHit,
    SchedulerEvent,
    SequenceFinished,
    SequencePreempted,
)
from pagedinfer.domain.executor import Executor
from pagedinfer.domain.forks import completion_seed, make_forks
from pagedinfer.domain.hashing import block_hash, chain_hashes, extend_chain
from pagedinfer.domain.lora import LoRARequest
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
from pagedinfer.domain.scheduler import (
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
    SchedulingPolicy,
)
from pagedinfer.domain.sequence import FinishReason, Sequence, SequenceStatus
from pagedinfer.domain.step_output import (
    EMPTY_STEP_OUTPUT,
    PromptLogprobsChunk,
    StepOutput,
    TokenLogprobs,
)
from pagedinfer.domain.structured import StructuredOutputsParams

__all__ = [
    "BLOCK_TABLE_FILLER",
    "EMPTY_STEP_OUTPUT",
    "PADDING_SLOT",
    "BatchPlan",
    "Block",
    "BlockPool",
    "DecodeBatch",
    "Executor",
    "FinishReason",
    "LoRARequest",
    "NewRequest",
    "PoolStats",
    "PrefixCacheHit",
    "PromptLogprobsChunk",
    "SamplingParams",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerEvent",
    "SchedulerStats",
    "SchedulingPolicy",
    "Sequence",
    "SequenceFinished",
    "SequencePreempted",
    "SequenceStatus",
    "StepOutput",
    "StructuredOutputsParams",
    "TokenLogprobs",
    "block_hash",
    "build_batch_plan",
    "cdiv",
    "chain_hashes",
    "completion_seed",
    "extend_chain",
    "make_forks",
    "mixed_batch_plan",
]

"""attnhub plugin ``ring``: ring attention (context parallelism) over torch.distributed.

Importing it imports torch.distributed only; no kernel and no GPU is touched until a call.
"""

from .backend import RingBackend, process_group_reasons
from .comm import RingError
from .functional import ring_attention
from .local_cpu import TorchFlashCPUBackend
from .merge import merge_partial
from .sharding import (
    ZigzagLayout,
    contiguous_shard,
    zigzag_shard,
    zigzag_shard_varlen,
    zigzag_unshard,
    zigzag_unshard_varlen,
)

__all__ = [
    "RingBackend",
    "RingError",
    "TorchFlashCPUBackend",
    "ZigzagLayout",
    "contiguous_shard",
    "merge_partial",
    "process_group_reasons",
    "ring_attention",
    "zigzag_shard",
    "zigzag_shard_varlen",
    "zigzag_unshard",
    "zigzag_unshard_varlen",
]

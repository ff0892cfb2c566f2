"""attnhub plugin hybrid_linear: linear (gla, linear, retention) and sparse (sliding_window,
longformer, lsh) attention backends, bound per layer by a policy, plus the per-sequence
recurrent state cache that linear layers decode with.
"""

from .state_cache import RecurrentStateCache

__all__ = ["RecurrentStateCache"]

"""`radixlm route`: a cache-aware HTTP router over `radixlm serve` replicas (no torch, no runtime import)."""

from radixlm.router.config import RouterConfig
from radixlm.router.policies import POLICIES, Choice, Policy, make_policy
from radixlm.router.tree import CharTree

__all__ = ["POLICIES", "CharTree", "Choice", "Policy", "RouterConfig", "make_policy"]

"""Worker selection as Filter -> Scorer -> Picker (the llm-d shape), one policy per role."""

from router.routing.framework import Filter, Picker, Policy, Scorer
from router.routing.policies import RoutingPolicies, build_policies

__all__ = ["Filter", "Picker", "Policy", "RoutingPolicies", "Scorer", "build_policies"]

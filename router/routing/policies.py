"""The named routing policies (PDSERVE_ROUTING_POLICY), each a prefill and a decode policy.
All apply the same filters (context fits, prefill token budget, decode KV room and request
slots, not a decode worker the request was lost on); they differ only in how they choose among
the workers that pass. An aggregated worker is chosen with both sides' filters, prefill's
scorers first. Given a prefix index, the watermark policy also weighs what each worker's prefix
cache holds (RoutingSettings.prefix_*_weight)."""

from __future__ import annotations

from dataclasses import dataclass

from router.prefix_index import PrefixIndex
from router.routing.filters import ContextFits, KVFits, NotExcluded, PrefillBudget, RequestSlots
from router.routing.framework import Filter, Policy, Scorer
from router.routing.pickers import LowestCost, PrefixHash, RoundRobin
from router.routing.scorers import KVSaved, KVUsage, PrefillSaved, RunningRequests, Watermark
from router.settings import AdmissionSettings, RoutingSettings


@dataclass(frozen=True, slots=True)
class RoutingPolicies:
    prefill: Policy
    decode: Policy
    aggregated: Policy | None = None  # None: aggregated workers are never chosen


def build_policies(
    routing: RoutingSettings, admission: AdmissionSettings, prefixes: PrefixIndex | None = None
) -> RoutingPolicies:
    # pass_through: no prefill budget and no KV room to wait for; the workers queue.
    passing = admission.mode == "pass_through"
    budget = () if passing else (PrefillBudget(admission.prefill_token_budget),)
    # A decode-side worker's room: KV for the request, and a request slot under its limit.
    kv_room = () if passing else (KVFits(), RequestSlots())
    prefill_filters: tuple[Filter, ...] = (ContextFits(), *budget)
    decode_filters: tuple[Filter, ...] = (ContextFits(), NotExcluded(), *kv_room)
    aggregated_filters = (*prefill_filters, NotExcluded(), *kv_room)
    if routing.policy == "watermark":
        prefill_scorers: tuple[tuple[float, Scorer], ...] = (
            (1.0, Watermark(routing.watermark_a, routing.watermark_b)),
        )
        decode_scorers: tuple[tuple[float, Scorer], ...] = (
            (1.0, KVUsage()),
            (1.0, RunningRequests()),
        )
        if prefixes is not None:
            prefill_scorers += _weighted(routing.prefix_prefill_weight, PrefillSaved(prefixes))
            decode_scorers += _weighted(routing.prefix_decode_weight, KVSaved(prefixes))
        return RoutingPolicies(
            Policy(prefill_filters, prefill_scorers, LowestCost()),
            Policy(decode_filters, decode_scorers, LowestCost()),
            Policy(aggregated_filters, (*prefill_scorers, (0.1, KVUsage())), LowestCost()),
        )
    # The baselines ignore load: each role gets its own rotation (or hash) of its workers.
    make_picker = RoundRobin if routing.policy == "round_robin" else PrefixHash
    return RoutingPolicies(
        Policy(prefill_filters, (), make_picker()), Policy(decode_filters, (), make_picker()),
        Policy(aggregated_filters, (), make_picker()),
    )  # fmt: skip


def _weighted(weight: float, scorer: Scorer) -> tuple[tuple[float, Scorer], ...]:
    return ((weight, scorer),) if weight > 0 else ()

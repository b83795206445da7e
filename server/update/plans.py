"""Validated plans by their content id, so a trainer can send a plan once and name it after."""

from __future__ import annotations

from collections import OrderedDict

from weightsync.common.plan_validation import PlanSummary
from weightsync.v1 import tensor_pb2


class ValidatedPlans:
    """Validated plans by their content id. Filled on commit only (caches change on success)."""

    def __init__(self, capacity: int = 8) -> None:
        self._plans: OrderedDict[str, tuple[tensor_pb2.WeightPlan, PlanSummary]] = OrderedDict()
        self._capacity = capacity

    def get(self, plan_id: str) -> tuple[tensor_pb2.WeightPlan, PlanSummary] | None:
        return self._plans.get(plan_id)

    def remember(self, plan_id: str, plan: tensor_pb2.WeightPlan, summary: PlanSummary) -> None:
        self._plans[plan_id] = (plan, summary)
        self._plans.move_to_end(plan_id)
        while len(self._plans) > self._capacity:
            self._plans.popitem(last=False)

"""vLLM's ranks: where a worker stands among them, the name it attaches as, and how they agree on an update.

Agreement: every rank agrees before any of them changes its model, and only the last one raises.

Why: vLLM 0.32's multiprocess executor (tensor or pipeline parallel > 1) reads its ranks' answers
to a collective call in rank order and raises at the first failed one, leaving the later ranks'
answers in their queues (vLLM's MultiprocExecutor.collective_rpc, its get_response).
The next call then reads those stale answers as its own: after one refused update every later
call would answer with the one before's outcome. So a refusal must reach vLLM from the last rank
alone. Every rank therefore publishes its outcome first (an all-gather over vLLM's own CPU group
of all its ranks, bounded by that group's timeout); if any refused, no rank touches its model,
the last rank raises an error naming every rank's outcome, and the others end vLLM's update
session on their worker themselves (what vLLM does for a rank that raises) and return.
"""

from __future__ import annotations

import gc

REFUSAL_CHARS = 300
"""Each rank's refusal is cut to this in the combined message."""


def world() -> tuple[int, int, object | None]:
    """(this worker's rank, the number of vLLM's ranks, their CPU group); (0, 1, None) outside vLLM's
    parallel groups."""
    try:
        from vllm.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return 0, 1, None
        group = parallel_state.get_world_group()
        return group.rank_in_group, group.world_size, group.cpu_group
    except Exception:  # noqa: BLE001 - no groups: one rank
        return 0, 1, None


def gather(group: object, size: int, label: str, refusal: str) -> list[tuple[str, str]]:
    """Every rank's (label, refusal; "" when ready), in rank order."""
    import torch.distributed

    outcomes: list = [None] * size
    torch.distributed.all_gather_object(outcomes, (label, refusal), group=group)
    return [tuple(o) for o in outcomes]


def combined(outcomes: list[tuple[str, str]]) -> tuple[str, str]:
    """The reason (the first refusing rank's) and a message naming each rank's outcome, ranks with the
    same outcome together."""
    by_outcome: dict[str, list[str]] = {}
    for label, refusal in outcomes:
        by_outcome.setdefault(refusal[:REFUSAL_CHARS], []).append(label)
    reason = next(r for _, r in outcomes if r).partition(":")[0]
    parts = [f"rank {', '.join(labels)} " + (f"refused: {text}" if text else "ready")
             for text, labels in by_outcome.items()]
    return reason, "the version not applied, the engine keeps its weights: " + "; ".join(parts)


def end_session(engine: object) -> None:
    """End vLLM's update session on this rank's worker, as vLLM does when the rank raises: the worker holds
    the engine as `weight_transfer_engine` and its session flag as `_weight_update_active` (vLLM 0.32)."""
    for holder in gc.get_referrers(engine):  # the worker's __dict__, or the worker itself (inline attributes)
        if isinstance(holder, dict):
            if holder.get("weight_transfer_engine") is engine and "_weight_update_active" in holder:
                holder["_weight_update_active"] = False
        elif getattr(holder, "weight_transfer_engine", None) is engine and hasattr(holder, "_weight_update_active"):
            holder._weight_update_active = False
    reset = getattr(engine, "reset_weight_update_target", None)
    if callable(reset):
        reset()


def model_parallel_rank() -> tuple[int, int, int, int]:
    """(tensor-parallel rank, size, pipeline-parallel rank, size) of this vLLM worker; (0, 1, 0, 1)
    where vLLM's parallel groups are not set up (a model used outside a vLLM worker)."""
    try:
        from vllm.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return 0, 1, 0, 1
        tp, pp = parallel_state.get_tp_group(), parallel_state.get_pp_group()
        return tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size
    except Exception:  # noqa: BLE001 - no groups: one rank
        return 0, 1, 0, 1


def rank_engine_name(name: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """The name a rank attaches as: `name` for the first rank (and "" stays "": a driven vLLM's
    ranks attach unnamed), NAME:tpR for the others (NAME:ppPtpR with pipeline parallelism). Each
    rank releases its own leases, so each reports what it applied under a name of its own: one
    shared record would show whichever rank released last."""
    if not name or (tp_rank == 0 and pp_rank == 0):
        return name
    return f"{name}:pp{pp_rank}tp{tp_rank}" if pp_size > 1 else f"{name}:tp{tp_rank}"

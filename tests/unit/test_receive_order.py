"""The receive order of parts over COLLECTIVE (common/receive_order.py): a literal table, and a wait-for check.

The check simulates every rank of a group (the parts, then the servers' workers) executing its transfers
with blocking point-to-point semantics, over many random plans (parts x buckets x owners, some buckets
stored by no worker of a server) and random delays (which rank moves next), in two models:
  - serialized: each rank runs one operation at a time, a send completing only when its receiver is at the
    matching receive (NCCL: each rank's ops serialized on its stream);
  - windowed: a part starts bucket k's sends before it waits for bucket k-1's, two buckets in flight at most
    (the client's CollectiveSink over Gloo), a worker receiving one bucket at a time;
  - batched: a part posts all of bucket k's sends at once, once bucket k-1's all completed (NCCL: one batch per
    bucket, a rank's batches one at a time on its stream); within a batch the sends complete in an order drawn at
    random, one after the other (whatever order NCCL's channels take them in, the worst being one at a time).
A deadlock is a state where no rank can move and some transfer is left. The global order never deadlocks;
a worker taking its buckets in the order their announcements reached it does (a literal case, and found
among random plans), so the check can fail.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from weightsync.common.receive_order import (
    receive_order,
    send_order,
    source_of,
    store_receive_order,
)


def test_receive_order_table():
    # (part, bucket) -> bucket index first, then part rank.
    assert receive_order([(1, 0), (0, 1), (0, 0), (2, 0), (1, 2)]) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 2)]
    assert receive_order([]) == []
    # A part's sends: bucket order, then owner rank.
    assert send_order([[5, 3], [], [4]]) == [(0, 3), (0, 5), (2, 4)]
    # The store's sequences: part 0's run starts at 0, part 1's at 3, part 2's at 5.
    lanes = [0, 3, 5]
    assert [source_of(s, lanes) for s in (0, 2, 3, 4, 5, 7)] == [(0, 0), (0, 2), (1, 0), (1, 1), (2, 0), (2, 2)]
    assert store_receive_order([7, 0, 4, 3, 5, 2], lanes) == [0, 3, 5, 4, 2, 7]
    # One part (no lanes): plan order.
    assert store_receive_order([4, 1, 2], []) == [1, 2, 4]


# -- the simulation ------------------------------------------------------------------------------
@dataclass
class Plan:
    parts: int
    workers: list[list[int]]
    """Per server, its workers' group ranks."""
    owners: list[list[list[int]]]
    """owners[p][k]: the group ranks that receive part p's bucket k (one per server storing some of it)."""

    def received_by(self, worker: int) -> list[tuple[int, int]]:
        return [(p, k) for p in range(self.parts) for k, ranks in enumerate(self.owners[p]) if worker in ranks]

    @property
    def all_workers(self) -> list[int]:
        return [w for server in self.workers for w in server]


def random_plan(rng: random.Random) -> Plan:
    parts = rng.randint(1, 4)
    workers, rank = [], parts
    for _ in range(rng.randint(1, 3)):
        count = rng.randint(1, 3)
        workers.append(list(range(rank, rank + count)))
        rank += count
    owners = []
    for _ in range(parts):
        buckets = []
        for _ in range(rng.randint(0, 6)):
            buckets.append([rng.choice(server) for server in workers if rng.random() > 0.15])
        owners.append(buckets)
    return Plan(parts, workers, owners)


def simulate(plan: Plan, orders: dict[int, list[tuple[int, int]]], rng: random.Random, *,
             window: int | str) -> bool:
    """True when every transfer completed; False at a deadlock. `orders`: each worker's (part, bucket) order.
    window 1: serialized (a part's sends one at a time, in send_order); 2: a part posts bucket k's sends, then
    waits for bucket k-1's (two buckets in flight); "batched": a part posts all of bucket k's sends once bucket
    k-1's completed, and they complete one after the other in an order drawn when they are posted."""
    sends = {p: send_order(plan.owners[p]) for p in range(plan.parts)}
    posted: dict[int, list[tuple[int, int]]] = {p: [] for p in sends}  # started, not completed
    next_send = {p: 0 for p in sends}
    receiving = {w: list(order) for w, order in orders.items()}
    while True:
        moves = []
        for p in sends:
            if next_send[p] < len(sends[p]):
                bucket = sends[p][next_send[p]][0]
                if window in (1, "batched"):
                    can_post = not posted[p]
                else:  # bucket k's sends start once every send of bucket k-2 and earlier completed
                    can_post = all(b >= bucket - 1 for b, _ in posted[p])
                if can_post:
                    moves.append(("post", p))
            # A batch's sends complete one after the other, in its drawn order; the others' in any order.
            for bucket, owner in posted[p][:1] if window == "batched" else posted[p]:
                if receiving[owner] and receiving[owner][0] == (p, bucket):
                    moves.append(("complete", p, bucket, owner))
        if not moves:
            return all(not left for left in receiving.values()) and all(not v for v in posted.values())
        move = rng.choice(moves)
        if move[0] == "post":
            p = move[1]
            if window == "batched":  # the whole bucket at once
                bucket = sends[p][next_send[p]][0]
                batch = [send for send in sends[p][next_send[p]:] if send[0] == bucket]
                posted[p] = rng.sample(batch, len(batch))
                next_send[p] += len(batch)
                continue
            posted[p].append(sends[p][next_send[p]])
            next_send[p] += 1
        else:
            _, p, bucket, owner = move
            posted[p].remove((bucket, owner))
            receiving[owner].pop(0)


def global_orders(plan: Plan) -> dict[int, list[tuple[int, int]]]:
    return {w: receive_order(plan.received_by(w)) for w in plan.all_workers}


def arrival_orders(plan: Plan, rng: random.Random) -> dict[int, list[tuple[int, int]]]:
    """Each worker's buckets in the order their announcements reached its server: the parts' announcements
    interleaved at random, each part's own in its bucket order (what a server forwarding as it reads would do)."""
    orders = {}
    for w in plan.all_workers:
        queues = {p: [(p, k) for q, k in plan.received_by(w) if q == p] for p in range(plan.parts)}
        order = []
        while any(queues.values()):
            p = rng.choice([p for p, q in queues.items() if q])
            order.append(queues[p].pop(0))
        orders[w] = order
    return orders


@pytest.mark.parametrize("window", [1, 2, "batched"], ids=["serialized", "windowed", "batched"])
def test_global_order_never_deadlocks(window):
    rng = random.Random(35_000 + (window if isinstance(window, int) else 3))
    for _ in range(600):
        plan = random_plan(rng)
        orders = global_orders(plan)
        for _ in range(5):  # random delays: which rank moves next
            assert simulate(plan, orders, rng, window=window), plan


def test_arrival_order_deadlocks_literal():
    """Part 0's bucket 0 goes to worker B and its bucket 1 to worker A; part 1's the other way round. A took part
    0's bucket 1 first (part 1 was slow to announce), B part 1's bucket 1: each part's first send waits on a
    worker that waits on the other part."""
    a, b = 2, 3
    plan = Plan(2, [[a], [b]], [[[b], [a]], [[a], [b]]])
    arrival = {a: [(0, 1), (1, 0)], b: [(1, 1), (0, 0)]}
    for window in (1, "batched"):
        assert not simulate(plan, arrival, random.Random(1), window=window)
        assert all(simulate(plan, global_orders(plan), random.Random(seed), window=window) for seed in range(20))


@pytest.mark.parametrize("window", [1, "batched"], ids=["serialized", "batched"])
def test_arrival_order_deadlocks_among_random_plans(window):
    rng = random.Random(7)
    deadlocked = 0
    for _ in range(400):
        plan = random_plan(rng)
        if not simulate(plan, arrival_orders(plan, rng), rng, window=window):
            deadlocked += 1
    assert deadlocked > 0


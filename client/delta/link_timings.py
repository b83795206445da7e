"""What this client measured of each transport's link: the dense throughput auto's thresholds use.

One LinkTimings per WeightSyncClient. A push reads the figure of its own transport
(`bytes_per_second`) and, once committed, adds what it measured (`dense_push_timed` for a dense
push into stores that existed, `link_timed` for a patched one that spent most of its time waiting
on the transport, `node_timed` for a dense push of a part: what the nodes measured of the whole
update, every part's bytes). Until a transport is timed, the benchmark machine's figure is assumed
(policy.ASSUMED_BYTES_PER_SECOND).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from weightsync.client.delta.policy import (
    ASSUMED_BYTES_PER_SECOND,
    LOOPBACK_BYTES_PER_SECOND,
    host_crossover,
)
from weightsync.client.types import ServerOutcome

DENSE_TIMING_MIN_BYTES = 64 << 20
"""Smaller dense pushes are timed by their fixed costs, not the link."""
DENSE_TIMINGS_KEPT = 8
LINK_TIMING_MIN_BYTES = 1 << 20
LINK_BOUND_FRACTION = 0.3
SLOWER_LINK_BELOW = 0.5


class LinkTimings:
    """Per transport, bytes per second of this client's recent dense pushes."""

    def __init__(self) -> None:
        self.dense_throughputs: dict[str, list[float]] = {}
        """Per transport, bytes per second of this client's recent dense pushes (of at least
        DENSE_TIMING_MIN_BYTES, into stores that existed)."""

    def dense_push_timed(self, transport: str, size_bytes: int, seconds: float) -> None:
        """A dense push's bytes and seconds: what the link and the servers take, for auto's thresholds."""
        if size_bytes >= DENSE_TIMING_MIN_BYTES and seconds > 0:
            self._add(transport, size_bytes / seconds)

    def node_timed(self, transport: str, outcomes: Iterable[ServerOutcome]) -> None:
        """A dense update sent in parts, into stores that existed: what each node measured of the whole
        update (UpdateCommitted: the bytes it received from every part, over the seconds from this part's
        Begin to the commit), the slowest node's figure. A part's own bytes over those seconds would
        understate the link by the number of parts."""
        rates = [(o.size_bytes / o.seconds, o) for o in outcomes if o.seconds > 0]
        if rates:
            _, slowest = min(rates, key=lambda r: r[0])
            self.dense_push_timed(transport, slowest.size_bytes, slowest.seconds)

    def link_timed(self, transport: str, size_bytes: int, wire_seconds: float, seconds: float) -> None:
        """A push that sent patches but spent a good part of its time waiting on the transport: its
        bytes over that wait, kept only when well below the rate assumed for the transport (a link
        clearly slower than the benchmark machine's loopback; there a wait says more about a busy
        host than about the link). Without it a client on a slow link that never timed a dense push kept
        the loopback's thresholds: at 3% changed over 1 Gbit/s its INLINE pushes mixed ever more dense
        tensors, 7%, 28%, 46%, 51%, then 100% of the bytes (each timed by nothing), instead of patches."""
        if size_bytes >= LINK_TIMING_MIN_BYTES and seconds > 0 and wire_seconds >= LINK_BOUND_FRACTION * seconds:
            rate = size_bytes / wire_seconds
            if rate < SLOWER_LINK_BELOW * ASSUMED_BYTES_PER_SECOND.get(transport, LOOPBACK_BYTES_PER_SECOND):
                self._add(transport, rate)

    def _add(self, transport: str, rate: float) -> None:
        recent = self.dense_throughputs.get(transport, [])
        self.dense_throughputs[transport] = [*recent[-(DENSE_TIMINGS_KEPT - 1):], rate]

    def bytes_per_second(self, transport: str) -> float:
        """The best of the recent dense pushes over this transport: the link's capacity, not a push
        slowed by a busy host. Optimistic on purpose: a faster link makes auto compare less, so a
        wrong guess costs patches, not a push slower than dense. Assumed until timed."""
        timed = self.dense_throughputs.get(transport)
        assumed = ASSUMED_BYTES_PER_SECOND.get(transport, LOOPBACK_BYTES_PER_SECOND)
        if transport == "shm":
            # Memory, not a network: a slow first push (the ingress slots' first touch) says nothing.
            return max([assumed, *(timed or [])])
        return max(timed) if timed else assumed

    def cannot_pay(self, named: list[tuple[str, torch.Tensor]], transport: str) -> bool:
        """delta="auto" with host tensors only, over SHM or at a dense throughput where no patch pays:
        not even sampled, and no copy kept. Over SHM patches pay only below ~1.4% changed on the
        benchmark machine (1.49x at 0.1%, 1.28x at 0.5%), and keeping them in reach cost more at
        the densities RL steps have: at 1-5% changed auto ran 0.89-0.95x dense (the samples, the
        copies taken again, comparisons near the crossover against a 0.17 s dense push), and the
        AdamW fine-tune at lr 1e-6 and 3e-6 0.88x and 0.84x (bench --only delta). delta=True
        still patches over SHM."""
        on_host = all(not t.is_cuda for _, t in named)
        return on_host and (transport == "shm" or host_crossover(self.bytes_per_second(transport)) == 0.0)

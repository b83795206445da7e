"""bench/host_path.py's pure parts: the alternation, the ratios, the passes table (no server)."""

from __future__ import annotations

from bench.host_path import orders, passes_rows, summarize


def test_the_modes_alternate_their_order_every_repetition():
    assert orders(("memcpy", "shm", "inline"), 3) == [("memcpy", "shm", "inline"), ("inline", "shm", "memcpy"),
                                                       ("memcpy", "shm", "inline")]


def test_ratios_are_against_the_memcpy_of_the_same_run_and_of_each_repetition():
    wall = {"memcpy": [0.10, 0.20, 0.10], "shm": [0.15, 0.20, 0.13]}
    cpu = {"memcpy": [{"trainer": 0.08, "server": 0, "worker": 0}] * 3,
           "shm": [{"trainer": 0.1, "server": 0.02, "worker": s} for s in (0.04, 0.0, 0.08)]}
    rows = {r["mode"]: r for r in summarize(wall, cpu, 10**9)}
    assert rows["shm"]["median_seconds"] == 0.15 and rows["shm"]["x_memcpy"] == 1.5
    assert rows["shm"]["per_rep_x_memcpy"] == 1.3  # 1.5, 1.0, 1.3
    assert rows["shm"]["cpu_x_memcpy"] == 2.0 and rows["memcpy"]["x_memcpy"] == 1.0
    assert rows["shm"]["median_cpu_by_role"] == {"trainer": 0.1, "server": 0.02, "worker": 0.04}
    assert rows["shm"]["gbps"] == round(1 / 0.15, 3)


def test_the_passes_table_adds_copies_and_reads_per_transport():
    rows = passes_rows({"shm": {"copy trainer.store": 1.0, "read worker.check": 1.001},
                        "inline": {"copy trainer.encode": 1.0, "copy server.ingress": 1.0,
                                   "copy worker.from_ingress": 1.0}})
    assert rows == ["| shm | 1.00 | 1.00 | copy trainer.store 1.00, read worker.check 1.00 |",
                    "| inline | 3.00 | 0.00 | copy trainer.encode 1.00, copy server.ingress 1.00, "
                    "copy worker.from_ingress 1.00 |"]

"""The pure pieces of bench/multi_sender.py: the split of whole tensors among senders, the rate words and the
table (no timing here: the bench itself measures)."""

from __future__ import annotations

import pytest

from bench.multi_sender import (
    MIB,
    Row,
    markdown_table,
    model_sizes,
    parse_rate,
    rows_table,
    split_tensors,
)

SIZES = [("a", 100), ("b", 400), ("c", 300), ("d", 200), ("e", 100)]


@pytest.mark.parametrize(("senders", "expected"), [
    (1, [["a", "b", "c", "d", "e"]]),
    # largest first (b, c, d, a, e), each to the sender holding the fewest bytes, the lower index on a tie:
    # b->0, c->1, d->1 (300 < 400), a->0 (400 < 500), e->0 (500 = 500); each share in the model's order
    (2, [["a", "b", "e"], ["c", "d"]]),
    # b->0, c->1, d->2, a->2 (200 < 300), e->1 (300 = 300)
    (3, [["b"], ["c", "e"], ["a", "d"]]),
    (5, [["b"], ["c"], ["d"], ["a"], ["e"]]),
    (6, [["b"], ["c"], ["d"], ["a"], ["e"], []]),
])
def test_split_whole_tensors_by_bytes(senders, expected):
    shares = split_tensors(SIZES, senders)
    assert shares == expected
    assert sorted(n for share in shares for n in share) == ["a", "b", "c", "d", "e"]  # each tensor once


def test_split_of_the_bench_model_is_even():
    sizes = model_sizes(128 * MIB, 64)
    assert len(sizes) == 64 and sum(s for _, s in sizes) == 128 * MIB
    shares = split_tensors(sizes, 4)
    assert [len(s) for s in shares] == [16, 16, 16, 16]
    assert shares[0][:3] == ["layers.0.weight", "layers.4.weight", "layers.8.weight"]


def test_split_refuses_no_senders():
    with pytest.raises(ValueError, match="senders must be >= 1, got 0"):
        split_tensors(SIZES, 0)


@pytest.mark.parametrize(("rate", "bits"), [("300mbit", 300e6), ("1gbit", 1e9), ("500kbit", 5e5), ("2.5Gbit", 2.5e9)])
def test_parse_rate(rate, bits):
    assert parse_rate(rate) == bits


def test_parse_rate_refuses_other_words():
    with pytest.raises(ValueError, match="a number and kbit, mbit or gbit"):
        parse_rate("300mbps")


def test_table_medians_throughput_and_ratio_to_gather():
    rows = [Row("gather", 1, (8.0, 7.0, 9.0), 100_000_000, 2), Row("parts 1", 1, (8.0, 8.0), 100_000_000, 2),
            Row("parts 2", 2, (4.0, 3.0, 5.0, 100.0), 100_000_000, 2), Row("parts 4", 4, (2.0,), 100_000_000, 2)]
    # 100 MB to 2 servers over 200 Mbit/s links: 8 s at line rate for one sender, 4 s for 2, 2 s for 4
    table = rows_table(rows, 200e6)
    assert [(t["row"], t["median_seconds"], t["aggregate_mb_per_s"], t["line_rate_seconds"], t["of_line_rate"],
             t["speedup_vs_gather"]) for t in table] == [
        ("gather", 8.0, 25.0, 8.0, 1.0, 1.0), ("parts 1", 8.0, 25.0, 8.0, 1.0, 1.0),
        ("parts 2", 4.5, 44.4, 4.0, 0.89, 1.78), ("parts 4", 2.0, 100.0, 2.0, 1.0, 4.0)]
    assert markdown_table(table) == (
        "| row | senders | median s | runs (s) | aggregate MB/s (all servers) | s at line rate | of line rate "
        "| vs gather |\n"
        "|---|---:|---:|---|---:|---:|---:|---:|\n"
        "| gather | 1 | 8.00 | 8.00, 7.00, 9.00 | 25.0 | 8.00 | 100% | 1.00x |\n"
        "| parts 1 | 1 | 8.00 | 8.00, 8.00 | 25.0 | 8.00 | 100% | 1.00x |\n"
        "| parts 2 | 2 | 4.50 | 4.00, 3.00, 5.00, 100.00 | 44.4 | 4.00 | 89% | 1.78x |\n"
        "| parts 4 | 4 | 2.00 | 2.00 | 100.0 | 2.00 | 100% | 4.00x |\n")

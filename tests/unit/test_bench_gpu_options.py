"""bench.gpu's section choice, without a GPU: what a lent machine runs for issue 45's goals (push over SHM
against a pinned device-to-host copy at 0.5 GB and 8 GB, the colocated round trip) fits the kit's bench step
only without the other sections, and at 8 GB without INLINE (bench/gpu.py)."""

from __future__ import annotations

import pytest

from bench import gpu


@pytest.mark.parametrize(("argv", "only", "no_inline"), [
    ([], None, False),
    (["--only", "push"], ["push"], False),
    (["--only", "push", "--only", "roundtrip", "--no-inline"], ["push", "roundtrip"], True),
    (["--only", "pause", "--only", "map", "--only", "engine"], ["pause", "map", "engine"], False),
])
def test_bench_gpu_sections_asked_for(argv, only, no_inline):
    args = gpu.parse_args(["--out", "x", *argv])
    assert (args.only, args.no_inline) == (only, no_inline)


def test_bench_gpu_refuses_a_section_it_does_not_have():
    with pytest.raises(SystemExit):
        gpu.parse_args(["--out", "x", "--only", "pushes"])


def test_every_section_says_what_it_checked():
    assert list(gpu.CHECKED) == list(gpu.SECTIONS) == ["push", "roundtrip", "engine", "map", "pause"]

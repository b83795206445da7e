"""How long a worker may take to map new arenas of the node store grows with their bytes
(server/store/arenas.py map_timeout): a fixed bound killed the workers of a large model at every map,
and each restarted worker mapped everything again."""

from __future__ import annotations

import pytest

from weightsync.server.store.arenas import map_timeout

GIB = 1 << 30


@pytest.mark.parametrize(
    ("base_seconds", "size_bytes", "expected_seconds"),
    [
        (120.0, 0, 120.0),  # nothing new to map: the command's own bound
        (120.0, 4096, 120.0 + 4096 / GIB),
        (120.0, GIB, 121.0),
        (120.0, 16 * GIB, 136.0),
        (120.0, 280 * GIB, 400.0),  # a 140 GB model and its STAGED shadow
        (5.0, 2 * GIB, 7.0),
        (5.0, -1, 5.0),  # a nonsense size never shortens the bound
    ],
)
def test_the_map_bound_is_the_command_bound_plus_a_second_per_gib(base_seconds, size_bytes, expected_seconds):
    assert map_timeout(base_seconds, size_bytes) == pytest.approx(expected_seconds, abs=1e-9)

"""Task ids: a ULID's text, as Crockford's base 32 spells it, and the order one process makes."""

from __future__ import annotations

import random

import pytest

from asynctaskd.keys import new_task_id, ulid_text

CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def spelled(value: int) -> str:
    """The ULID text of a 128-bit value, five bits at a time from the least significant."""
    chars = []
    for _ in range(26):
        chars.append(CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))


@pytest.mark.parametrize(
    "value",
    [0, 1, 31, 32, (1 << 128) - 1, 1 << 127, (1 << 80) - 1, 0x0123456789ABCDEF << 64],
)
def test_a_ulid_is_spelled_as_crockfords_base_32(value: int) -> None:
    assert ulid_text(value) == spelled(value)


def test_random_values_are_spelled_alike() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        value = rng.getrandbits(128)
        assert ulid_text(value) == spelled(value)


def test_ids_of_one_millisecond_sort_in_the_order_they_were_made() -> None:
    # (an earlier millisecond than the process's last id takes that one's: monotonic)
    ids = [new_task_id(now_ms=1_764_000_000_000) for _ in range(100)]
    assert ids == sorted(ids, key=str.encode) and len(set(ids)) == 100
    assert all(len(i) == 26 and set(i) <= set(CROCKFORD) for i in ids)
    assert len({i[:10] for i in ids}) == 1  # the time leads: ten characters of milliseconds
    assert new_task_id(3).endswith("-3")

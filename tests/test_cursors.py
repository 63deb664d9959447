"""list() cursors without Redis: what is sealed comes back, and nothing else opens."""

from __future__ import annotations

import base64

import pytest

from asynctaskd.cursors import Position, derive_key, filters_of, open_cursor, seal
from asynctaskd.errors import InvalidTask
from asynctaskd.keys import new_task_id

KEY = derive_key(b"k" * 32)
FILTERS = filters_of(None, None, "t1")

POSITIONS = [
    Position(0, 0, None, b""),
    Position(8, 1023, 2**53, new_task_id(1023).encode()),
    Position(3, 0, -5, new_task_id().encode()),
    Position(1, 2, 0, b"x" * 45),  # not a task id (a corrupt index entry): still a position
]


@pytest.mark.parametrize("position", POSITIONS)
def test_a_sealed_position_comes_back_and_only_under_its_key_and_filters(
    position: Position,
) -> None:
    cursor = seal(KEY, FILTERS, position)
    assert open_cursor(KEY, FILTERS, cursor) == position
    assert seal(KEY, FILTERS, position) == cursor  # deterministic: stable across calls
    if position.member:
        assert position.member not in base64.urlsafe_b64decode(cursor + "==")
    with pytest.raises(InvalidTask, match="cursor key has changed"):
        open_cursor(derive_key(b"other"), FILTERS, cursor)
    with pytest.raises(InvalidTask, match="with other filters"):
        open_cursor(KEY, filters_of(None, None, "t2"), cursor)


def test_task_id_positions_make_cursors_of_one_length() -> None:
    lengths = {len(seal(KEY, FILTERS, p)) for p in POSITIONS[:3]}
    assert lengths == {92}  # the length tells neither the shard nor where the walk is


def test_every_edited_byte_is_refused() -> None:
    token = base64.urlsafe_b64decode(seal(KEY, FILTERS, POSITIONS[1]))
    for i in range(len(token)):
        edited = token[:i] + bytes([token[i] ^ 1]) + token[i + 1 :]
        with pytest.raises(InvalidTask):
            open_cursor(KEY, FILTERS, base64.urlsafe_b64encode(edited).decode())
    for junk in ("", "garbage", "=" * 8, None, 17, "A" * 92):
        with pytest.raises(InvalidTask, match="was not returned by list"):
            open_cursor(KEY, FILTERS, junk)

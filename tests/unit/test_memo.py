"""Memo: one computation per key; a bounded table is cleared when full, never grows past its limit."""

from policies.memo import Memo


def test_computes_once_per_key_including_falsy_values():
    calls = []
    memo = Memo(lambda a, b: calls.append((a, b)) or a == b)
    assert memo(1, 2) is False and memo(1, 2) is False and memo(3, 3) is True
    assert calls == [(1, 2), (3, 3)]


def test_a_bounded_table_is_cleared_when_full():
    memo = Memo(str, limit=3)
    for i in range(10):
        memo(i)
        assert len(memo.table) <= 3
    assert memo(9) == "9" and (9,) in memo.table

"""A Redis script's reply is checked for its shape before the rate limiter or the fleet caps read it
(policies/store/pipelined.py): a malformed one is redis-py's InvalidResponse, a RedisError, which the store's
guard turns into the store's own error like any other, never a TypeError deep in the request path."""

from __future__ import annotations

import pytest
from redis import exceptions as redis_errors

from policies.store.pipelined import integer, integers, pack, row


def test_a_well_formed_reply_is_read_as_numbers_and_strings():
    assert row([1, "0", "", 2]) == [1, "0", "", 2]
    assert row([1, "x"], 2) == [1, "x"]
    assert integers([1, "2", 3, -1], 4) == [1, 2, 3, -1]
    assert integer(7) == 7 and integer("12") == 12


@pytest.mark.parametrize("reply, size", [
    (None, None), (5, None), ("1", None), ([1, 2], 3), ([1, None], 2), ([1, [2]], 2), ([1, b"x"], 2),
])
def test_a_reply_of_another_shape_is_an_invalid_response(reply, size):
    with pytest.raises(redis_errors.InvalidResponse):
        row(reply, size)


@pytest.mark.parametrize("reply", [None, True, 1.5, "one", [1], b"1"])
def test_an_integer_reply_that_is_not_one_is_an_invalid_response(reply):
    with pytest.raises(redis_errors.InvalidResponse):
        integer(reply)
    assert issubclass(redis_errors.InvalidResponse, redis_errors.RedisError)  # what the store's guard maps


def test_arguments_go_on_the_wire_as_their_text():
    assert pack(("EVALSHA", b"ab", 2, 1.5)) == b"*4\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n2\r\n$3\r\n1.5\r\n"

"""Token counts an upstream reports are read one way everywhere (the finished-call record, budgets, rate limits):
a positive int counts, anything else counts 0, so no backend or provider can lower a spend or give a limit back."""

import pytest

from policies.tokens import used_tokens


@pytest.mark.parametrize("usage, expected", [
    ({"prompt_tokens": 11, "completion_tokens": 5}, (11, 5)),
    ({"prompt_tokens": -1_000_000, "completion_tokens": 5}, (0, 5)),  # a "refund" of a million tokens
    ({"prompt_tokens": "11", "completion_tokens": 5.5}, (0, 0)),  # strings and floats are not counts
    ({"prompt_tokens": True, "completion_tokens": None}, (0, 0)),
    ({}, (0, 0)),
    (None, (0, 0)),
    ([11, 5], (0, 0)),
])
def test_a_reported_count_is_a_positive_int_or_nothing(usage, expected):
    assert used_tokens(usage) == expected


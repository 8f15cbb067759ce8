"""The retry budget's sliding window (policies/retries.py), on a clock the test moves."""

from policies.retries import RetryBudget


def test_retries_stop_at_the_budget_share_of_the_window_requests():
    budget = RetryBudget(0.2, window=10.0, min_retries=0)
    for i in range(100):
        budget.request(i * 0.05)  # 100 requests over 5 s
    allowed = sum(budget.try_retry(5.0) for _ in range(50))
    assert allowed == 20  # 20% of 100
    assert budget.counts() == (100, 20)


def test_min_retries_allow_a_few_retries_with_little_traffic():
    budget = RetryBudget(0.2, window=10.0, min_retries=3)
    budget.request(0.0)
    assert [budget.try_retry(0.1) for _ in range(5)] == [True, True, True, True, False]  # 0.2 x 1 + 3


def test_the_window_slides_old_requests_and_retries_out():
    budget = RetryBudget(0.5, window=10.0, min_retries=0)
    for _ in range(10):
        budget.request(100.0)
    assert sum(budget.try_retry(100.5) for _ in range(10)) == 5
    assert not budget.try_retry(105.0)  # still inside the window: spent
    # 10 s later the slot of t=100 has left the window: nothing counted, so nothing may be retried
    assert budget.counts() == (10, 5)
    assert not budget.try_retry(110.5)
    assert budget.counts() == (0, 0)
    for _ in range(4):
        budget.request(111.0)
    assert sum(budget.try_retry(111.0) for _ in range(4)) == 2  # a fresh window, a fresh share


def test_a_partly_passed_window_keeps_the_recent_slots():
    budget = RetryBudget(1.0, window=10.0, min_retries=0)
    budget.request(0.0)  # slot 0
    budget.request(6.0)  # slot 6
    assert budget.try_retry(6.0) and budget.try_retry(6.0)
    assert budget.counts() == (2, 2)
    budget.request(10.5)  # slot 10: slot 0 (t=0) left the window, slot 6 stays
    assert budget.counts() == (2, 2)
    assert not budget.try_retry(10.5)  # 2 retries against 2 requests: spent
    assert budget.try_retry(16.5)  # slot 6 left too: the one request of t=10.5 allows one retry
    assert budget.counts() == (1, 1) and not budget.try_retry(16.5)


def test_a_clock_that_goes_back_counts_on_in_the_current_slot():
    budget = RetryBudget(1.0, window=10.0, min_retries=0)
    budget.request(50.0)
    budget.request(49.0)
    assert budget.counts() == (2, 0) and budget.try_retry(48.0)

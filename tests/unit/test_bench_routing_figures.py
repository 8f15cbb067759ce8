"""The routing benchmark's per-run figures from vLLM's histograms (before and after a run, both servers): the
mean from _sum/_count, the median from the buckets as Prometheus' histogram_quantile reads them."""

from tests.benchmarks.routing import histogram, histogram_delta, histogram_figures
from tests.e2e.vllm_procs import parse_metrics


def exposition(queue_sum, counts):
    edges = ("0.1", "0.5", "1.0", "+Inf")
    lines = ["# TYPE vllm:request_queue_time_seconds histogram"]
    lines += [f'vllm:request_queue_time_seconds_bucket{{engine="0",le="{le}"}} {n}' for le, n in zip(edges, counts)]
    lines += [f'vllm:request_queue_time_seconds_sum{{engine="0"}} {queue_sum}',
              f'vllm:request_queue_time_seconds_count{{engine="0"}} {counts[-1]}']
    return histogram(parse_metrics("\n".join(lines) + "\n"), "vllm:request_queue_time_seconds")


def test_a_runs_figures_are_the_difference_over_both_servers():
    before = [exposition(1.0, [10, 10, 10, 10]), exposition(0.0, [0, 0, 0, 0])]
    # over the run: server a 10 more requests, all under 0.1 s; server b 10, between 0.1 and 0.5 s
    after = [exposition(1.5, [20, 20, 20, 20]), exposition(3.0, [0, 10, 10, 10])]
    figures = histogram_figures(histogram_delta(before, after))
    assert figures["count"] == 20 and figures["mean_ms"] == 175.0  # 3.5 s over 20 requests
    assert figures["p50_ms"] == 100.0  # the 10th of 20 is the last in the first bucket: its upper edge


def test_the_median_is_interpolated_in_its_bucket_and_an_open_bucket_gives_its_lower_edge():
    assert histogram_figures(exposition(4.0, [0, 8, 8, 8]))["p50_ms"] == 300.0  # 4th of 8, all in 0.1-0.5: its middle
    assert histogram_figures(exposition(20.0, [1, 1, 1, 8]))["p50_ms"] == 1000.0  # past the last finite edge
    assert histogram_figures(exposition(0.0, [0, 0, 0, 0])) == {"mean_ms": None, "p50_ms": None, "count": 0}

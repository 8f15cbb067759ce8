"""The GPU benchmark's checks (tests/benchmarks/gpu/summarize.py) pass and miss on the figures they are given."""

from tests.benchmarks.gpu.summarize import checks


def row(concurrency, tok_s, ttft_p99_ms, backend_ttft_p99_ms=None, errors=0, refused=0):
    return {"concurrency": concurrency, "out_tok_per_s": tok_s, "ttft_p99_ms": ttft_p99_ms,
            "backend_ttft_p99_ms": backend_ttft_p99_ms if backend_ttft_p99_ms is not None else ttft_p99_ms,
            "errors": errors, "refused_429": refused}


def level(concurrency, held):
    return {"concurrency": concurrency, "in_flight_mean": held}


DIRECT = {"rows": [row(128, 12_000, 600), row(256, 8_500, 1_200), row(512, 8_600, 4_000)]}


KNEE_AT_512 = (level(512, 512.0),)


def verdicts(gateway_rows, knee_levels=KNEE_AT_512):
    return checks({"bf16": {"levels": list(knee_levels)}}, {"direct": DIRECT, "gateway": {"rows": gateway_rows}}, 128)


def test_a_gateway_that_holds_the_peak_and_the_latency_passes_every_check():
    results = verdicts([row(256, 11_700, 2_000, 590), row(512, 12_100, 4_500, 610, refused=3)])
    assert results and all(ok for ok, _ in results)


def test_throughput_under_95_percent_of_the_peak_misses():
    results = verdicts([row(256, 11_300, 2_000, 590)])  # 94.2% of 12,000
    assert [text for ok, text in results if not ok] == ["gateway x2: 11,300 tok/s = 94.2% of the peak 12,000"]


def test_backend_ttft_over_one_and_a_half_times_the_at_knee_value_misses():
    results = verdicts([row(512, 12_000, 5_000, 901)])
    assert any(not ok and "backend TTFT p99 901 ms = 1.50x" in text for ok, text in results)


def test_a_failed_request_misses_but_clean_429s_do_not():
    results = verdicts([row(256, 12_000, 2_000, 590, errors=1), row(512, 12_000, 2_000, 590, refused=50)])
    failed = [text for ok, text in results if not ok]
    assert failed == ["gateway x2: 1 failed, 0 clean 429s"]


def test_a_knee_level_held_more_than_ten_percent_off_misses():
    results = verdicts([], knee_levels=(level(256, 256.0), level(512, 450.0)))
    assert [text for ok, text in results if not ok] == ["knee bf16 c=512: client held 450.0 in flight"]

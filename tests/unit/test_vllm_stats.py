from pathlib import Path

from tools.knee.client import parse_gauges
from backends.vllm_stats import parse_metrics, relevant_lines

SAMPLE = (Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32-cpu" / "metrics.txt").read_text()


def test_a_real_vllm_scrape():
    stats = parse_metrics(SAMPLE, scraped_at=1.0)
    assert (stats.running, stats.waiting, stats.kv_usage) == (0.0, 0.0, 0.0)
    assert (stats.prefix_queries, stats.prefix_hits) == (40.0, 0.0)
    assert (stats.block_size, stats.num_blocks, stats.cache_tokens) == (128, 4096, 524288)
    assert stats.requests_finished == 4.0  # every finished_reason summed
    assert stats.prefix_hit_rate == 0.0 and stats.load == 0.0
    assert len(relevant_lines(SAMPLE)) < len(SAMPLE) / 5  # the parser reads only what routing uses


def test_engines_are_summed_and_missing_families_stay_unknown():
    text = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
        "# TYPE vllm:prefix_cache_hits counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9',
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 10.0',
        "# TYPE vllm:prefix_cache_queries counter",
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 80.0',
        'vllm:num_requests_running_by_reason{engine="0",model_name="m"} 99.0',
    ])
    stats = parse_metrics(text)
    assert stats.running == 5.0 and stats.waiting is None and stats.load == 5.0
    assert stats.prefix_hits == 40.0 and stats.prefix_hit_rate == 0.5
    assert stats.kv_usage is None and stats.cache_tokens is None


def test_the_knee_reads_its_gauges_with_the_same_parser():
    gauges = parse_gauges('vllm:num_requests_waiting{engine="0"} 7.0\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n')
    assert gauges == {"vllm:num_requests_waiting": 7.0, "vllm:kv_cache_usage_perc": 0.25}

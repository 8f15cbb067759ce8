"""The knee finder on synthetic curves and on the curves in docs/field-notes.md."""

import random

import pytest

from tools.knee.analysis import Point, find_knee


def curve(levels, throughput, ttft_ms=None, errors=None):
    ttft_ms = ttft_ms or [None] * len(levels)
    errors = errors or [0] * len(levels)
    return [Point(c, t, None if l is None else l / 1000, e) for c, t, l, e in zip(levels, throughput, ttft_ms, errors)]


# The talk's BF16 Qwen3-4B on one small GPU: 1 -> 37.5 tok/s, 32 -> 714, 64 -> ~800 (TTFT 61 / 277 / 1300 ms).
TALK = curve([1, 32, 64], [37.5, 714, 800], [61, 277, 1300])
# The same shape measured at every doubling (values between the talk's points, linear in c up to the knee).
TALK_FULL = curve([1, 2, 4, 8, 16, 32, 64], [37.5, 75, 148, 290, 520, 714, 800], [61, 63, 70, 90, 150, 277, 1300])
# Measured here on one H200 (vLLM 0.26, 256/128 tokens): the throughput falls past 128.
H200 = [1, 8, 32, 64, 128, 256, 512]
H200_BF16 = curve(H200, [265, 1841, 5374, 8105, 10541, 7804, 9698], [31, 151, 211, 349, 679, 1153, 3652])
H200_FP8 = curve(H200, [324, 1997, 6109, 8647, 10521, 7996, 8250])
# Measured here: a real CPU vLLM on 2 cores, 64 output tokens.
CPU = curve([1, 4, 16, 64], [176, 568, 1662, 1913], [32, 51, 111, 627])
# A batch cap of 8 (the simulator's or vLLM's --max-num-seqs): flat from 8 on.
CAPPED = curve([1, 2, 4, 8, 16, 32], [96, 160, 320, 511, 511, 512], [19, 29, 37, 84, 253, 712])


def test_talk_gpu_knee_is_32():
    assert find_knee(TALK).recommended == 32
    assert find_knee(TALK_FULL).recommended == 32


def test_h200_knee_is_in_the_64_to_128_region_and_never_past_the_peak():
    for points in (H200_BF16, H200_FP8):
        knee = find_knee(points)
        assert knee.knee == knee.recommended
        assert knee.recommended in (64, 128)
        assert 256 not in knee.scores and 512 not in knee.scores  # cut at the peak


def test_cpu_table_knee_is_16():
    assert find_knee(CPU).recommended == 16


def test_batch_cap_is_found_even_when_noise_puts_the_peak_later():
    assert find_knee(CAPPED).recommended == 8
    rng = random.Random(7)
    for _ in range(50):
        noisy = [Point(p.concurrency, p.throughput * rng.uniform(0.97, 1.03)) for p in CAPPED]
        assert find_knee(noisy).recommended == 8


def test_a_throughput_tie_is_decided_by_where_ttft_explodes():
    # A real CPU vLLM on one core with --max-num-seqs 8 (measured here): 4 and 8 score alike on throughput,
    # but TTFT p99 only explodes past 8.
    one_core = curve([1, 4, 8, 16, 32], [136, 377, 482, 558, 512], [39, 131, 159, 692, 1679])
    knee = find_knee(one_core)
    assert knee.recommended == 8 and "TTFT p99 decided" in knee.reason
    without_ttft = curve([1, 4, 8, 16, 32], [136, 377, 482, 558, 512])
    assert find_knee(without_ttft).recommended == 4  # no latency to break the tie: the best score


def test_knee_climbs_while_throughput_pays_and_vllm_does_not_queue():
    # Measured here: one-core CPU vLLM, --max-num-seqs 8, 256/32 tokens. Kneedle alone says 4 (83% of the peak);
    # 8 still adds 21% with vLLM's queue empty, 16 queues (waiting 7.8) and adds nothing.
    levels, tput, ttft = [1, 2, 4, 8, 16, 32], [271, 475, 748, 904, 866, 891], [39, 34, 57, 134, 543, 1005]
    waiting = [0, 0, 0, 0, 7.8, 23.6]
    measured = [Point(c, t, l / 1000, 0, w) for c, t, l, w in zip(levels, tput, ttft, waiting)]
    knee = find_knee(measured)
    assert knee.recommended == 8 and "raised to c=8" in knee.reason
    assert find_knee(curve(levels, tput, ttft)).recommended == 4  # without vLLM's gauge: no climb
    queued_at_8 = [Point(p.concurrency, p.throughput, p.ttft_p99, 0, 2.0 if p.concurrency >= 8 else 0.0)
                   for p in measured]
    assert find_knee(queued_at_8).recommended == 4  # vLLM already queues at 8: stay below
    small_gain = [Point(p.concurrency, 780 if p.concurrency == 8 else p.throughput, p.ttft_p99, 0, p.waiting)
                  for p in measured]
    assert find_knee(small_gain).recommended == 4  # +4% is not worth the latency
    # The talk's GPU, had vLLM reported no queue at 64: +12% for TTFT p99 277 -> 1,300 ms is the explosion.
    talk = [Point(p.concurrency, p.throughput, p.ttft_p99, 0, 0.0) for p in TALK_FULL]
    assert find_knee(talk).recommended == 32
    h200 = [Point(p.concurrency, p.throughput, p.ttft_p99, 0, 0.0) for p in H200_BF16]
    assert find_knee(h200).recommended == 128  # +30% for 1.9x TTFT within the batch: worth it; 256 is past the peak


def test_slo_bounds_the_cap():
    knee = find_knee(H200_BF16, slo_ttft_p99=0.5)
    assert (knee.knee, knee.slo_level, knee.recommended) == (128, 64, 64)
    assert "SLO" in knee.reason
    knee = find_knee(CPU, slo_ttft_p99=0.1)
    assert (knee.knee, knee.slo_level, knee.recommended) == (16, 4, 4)


def test_slo_looser_than_the_knee_does_not_raise_the_cap():
    knee = find_knee(TALK_FULL, slo_ttft_p99=2.0)
    assert (knee.slo_level, knee.recommended) == (64, 32)


def test_slo_level_is_the_top_of_the_unbroken_run_of_levels_that_meet_it():
    points = curve([1, 2, 4, 8], [100, 200, 400, 800], [50, 300, 80, 90])  # 2 misses, 4 and 8 happen to meet
    assert find_knee(points, slo_ttft_p99=0.1).slo_level == 1
    no_ttft = curve([1, 2, 4], [100, 200, 300], [50, None, 60])  # no first token measured at 2: not met
    assert find_knee(no_ttft, slo_ttft_p99=0.1).slo_level == 1


def test_slo_missed_even_at_the_lowest_level_recommends_nothing():
    knee = find_knee(CPU, slo_ttft_p99=0.01)
    assert knee.recommended is None and knee.knee == 16
    assert "even at c=1" in knee.reason


def test_levels_with_errors_and_everything_above_them_are_never_recommended():
    broken = curve([1, 2, 4, 8, 16, 32], [96, 160, 320, 511, 511, 512], errors=[0, 0, 0, 0, 3, 0])
    knee = find_knee(broken)
    assert knee.recommended == 8 and "c=16 had 3 errors" in knee.reason
    broken = curve([1, 2, 4, 8, 16, 32], [96, 160, 320, 511, 511, 512], errors=[0, 0, 0, 1, 0, 0])
    assert find_knee(broken).recommended == 4  # only 1, 2, 4 are usable: fewer than 3 would be the best one
    broken = curve([1, 2, 4], [96, 160, 320], errors=[2, 0, 0])
    knee = find_knee(broken)
    assert knee.recommended is None and knee.knee is None and "errors" in knee.reason


def test_degenerate_curves_are_decided_deterministically():
    assert find_knee([]).recommended is None
    assert find_knee(curve([4], [300])).recommended == 4
    assert find_knee(curve([1, 8], [100, 700])).recommended == 8
    assert find_knee(curve([1, 8], [700, 100])).recommended == 1
    assert find_knee(curve([1, 8], [500, 500])).recommended == 1  # a tie goes to the smaller cap
    assert find_knee(curve([1, 2, 4, 8], [500, 510, 505, 498])).recommended == 1  # flat
    assert find_knee(curve([1, 2, 4, 8, 16], [100, 400, 300, 200, 150])).recommended == 2  # peak before a knee
    assert find_knee(curve([1, 2, 4], [0, 0, 0])).recommended is None
    assert find_knee(curve([1, 2, 4, 8], [0, 200, 390, 400])).recommended == 4  # c=1 made nothing: dropped


def test_a_curve_still_rising_steeply_has_its_knee_at_the_peak():
    linear = curve([1, 2, 4, 8, 16, 32], [100, 200, 400, 800, 1600, 3200])
    assert find_knee(linear).recommended == 32


def test_order_and_duplicates_of_the_input_do_not_matter():
    shuffled = list(TALK_FULL)
    random.Random(3).shuffle(shuffled)
    assert find_knee(shuffled) == find_knee(TALK_FULL)
    assert find_knee(TALK_FULL + [TALK_FULL[-1]]).recommended == 32


@pytest.mark.parametrize("points", [TALK_FULL, H200_BF16, CPU, CAPPED])
def test_report_form_is_json_ready(points):
    out = find_knee(points, slo_ttft_p99=0.5).to_dict()
    assert set(out) >= {"knee", "slo_level", "recommended", "reason", "method", "scores"}
    assert all(isinstance(k, str) for k in out["scores"])


def test_levels_whose_concurrency_was_not_held_are_warned_about():
    from tools.knee.report import concurrency_warnings
    from tools.knee.sweep import LevelResult

    def level(c, held, running, waiting=0.0, processes=1):
        return LevelResult(c, 10.0, 100, 0, 1000.0, 10.0, 0.1, 0.2, 0.01, 0.02, 1.0, 256.0, running_mean=running,
                           waiting_mean=waiting, in_flight_mean=held, processes=processes)

    warnings = concurrency_warnings([
        level(8, 7.9, 6.0, 1.5),  # held, and vLLM saw 7.5 of 8: within 10%
        level(256, 166.0, 160.0, 6.0),  # a client that could not keep up (the H200 case)
        level(64, 63.5, 40.0, 0.0, processes=2),  # the client held it, vLLM saw fewer
        level(4, None, None),  # nothing recorded: nothing to say
    ])
    assert len(warnings) == 3
    assert warnings[0].startswith("c=256: the client held 166.0 requests in flight on average, not 256 (1 client")
    assert warnings[1].startswith("c=256: vLLM saw 166.0 requests")
    assert warnings[2].startswith("c=64: vLLM saw 40.0 requests")


def test_the_guards_hold_when_no_knee_is_found():
    # A CPU vLLM with --max-num-seqs 8 (measured): no knee bulges above the chord, so the peak (16) was
    # recommended unchecked although vLLM queued 7 requests there and TTFT p99 was 5.4x level 8's.
    points = [Point(1, 231, .027, 0, 0), Point(2, 383, .048, 0, 0), Point(4, 659, .075, 0, 0),
              Point(8, 854, .144, 0, 0), Point(16, 1059, .772, 0, 7.0), Point(32, 1024, 1.889, 0, 23.4)]
    knee = find_knee(points)
    assert knee.recommended == 8 and "c=16 has vLLM waiting" in knee.reason
    # the TTFT guard alone (a server without the waiting gauge) refuses 16 too
    assert find_knee([Point(p.concurrency, p.throughput, p.ttft_p99) for p in points]).recommended == 8


def test_the_guards_hold_on_a_plateau():
    # Kneedle's point is the last level before the plateau, where vLLM already queues: one level down.
    plateau = [Point(1, 100, .02, 0, 0), Point(2, 200, .03, 0, 0), Point(4, 390, .04, 0, 0),
               Point(8, 760, .05, 0, 0), Point(16, 1500, .4, 0, 3.0), Point(32, 1510, 1.0, 0, 12)]
    knee = find_knee(plateau)
    assert knee.recommended == 8 and "c=16 has vLLM waiting" in knee.reason


def test_the_guards_hold_before_a_cliff_and_with_few_levels():
    # Throughput peaks at 4 and falls off a cliff; the peak queues and its TTFT exploded: down to 2.
    cliff = [Point(1, 200, .02, 0, 0), Point(2, 400, .03, 0, 0), Point(4, 800, .3, 0, 2.5),
             Point(8, 300, 2.0, 0, 20)]
    assert find_knee(cliff).recommended == 2
    assert find_knee(cliff[:2] + [Point(4, 800, .05, 0, 0.1)]).recommended == 4  # the same peak, not queuing
    # fewer than 3 levels: the best throughput level, unless it queues
    assert find_knee([Point(1, 200, .02, 0, 0), Point(2, 390, .2, 0, 4.0)]).recommended == 1
    # the smallest level is the floor: nothing safer can be offered
    assert find_knee([Point(1, 200, .5, 0, 3.0), Point(2, 390, 2.0, 0, 9.0)]).recommended == 1

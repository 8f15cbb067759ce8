"""Step 6's comparison (tests/benchmarks/gpu/variants_vs_knee.py): knee read at the load a server held, and the
10% check passing and missing on the figures it is given."""

import json
import sys

from tests.benchmarks.gpu import variants_vs_knee as vk

KNEE = {32: {"ttft_p50_s": 0.10, "output_tokens_per_s": 3000.0, "itl_p50_s": 0.010, "tpot_p50_s": 0.010},
        64: {"ttft_p50_s": 0.20, "output_tokens_per_s": 5000.0, "itl_p50_s": 0.012, "tpot_p50_s": 0.012}}


def test_knee_is_read_linearly_between_levels_and_at_the_edge_outside_them():
    mid = vk.at(KNEE, 48)
    assert mid["range"] == "in" and abs(mid["ttft_p50_s"] - 0.15) < 1e-9 and mid["output_tokens_per_s"] == 4000
    assert vk.at(KNEE, 20)["range"] == "below" and vk.at(KNEE, 20)["output_tokens_per_s"] == 3000
    assert vk.at(KNEE, 64)["range"] == "in" and vk.at(KNEE, 90)["range"] == "above"
    assert vk.at({}, 10) is None


def write_run(out, ttft_fp8, tok_fp8):
    for name in ("bf16", "fp8"):
        (out / f"knee6-{name}").mkdir()
        levels = [{"concurrency": c, **row} for c, row in KNEE.items()]
        (out / f"knee6-{name}" / "knee-x.json").write_text(json.dumps({"levels": levels}))
    run = out / "gw-128"
    run.mkdir()
    variant = {"weight": 50, "shadow": False, "requests": 300, "errors": {}, "itl_p50": 0.012,
               "tokens_per_second_p50": 80.0}
    (run / "variants.json").write_text(json.dumps({"models": {"qwen3-4b": {"variants": [
        {**variant, "name": "bf16", "ttft_p50": 0.20}, {**variant, "name": "fp8", "ttft_p50": ttft_fp8}]}}}))
    (run / "rates.json").write_text(json.dumps({"bf16": {"output_tokens_per_s": 5100.0, "held_mean": 64},
                                                "fp8": {"output_tokens_per_s": tok_fp8, "held_mean": 48}}))


def run_main(monkeypatch, out):
    monkeypatch.setattr(sys, "argv", ["variants_vs_knee.py", str(out)])
    code = vk.main()
    return code, json.loads((out / "variants-vs-knee.json").read_text())


def test_figures_within_ten_percent_of_knee_pass(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, ttft_fp8=0.16, tok_fp8=3900.0)  # knee at 48 streams: 0.15 s, 4,000 tok/s
    code, report = run_main(monkeypatch, tmp_path)
    assert code == 0 and len(report["checks"]) == 4 and all(ok for _, ok in report["checks"])


def test_a_variant_slower_than_its_knee_by_more_than_ten_percent_fails(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, ttft_fp8=0.15, tok_fp8=3500.0)  # 0.875x knee's 4,000 tok/s
    code, report = run_main(monkeypatch, tmp_path)
    failed = [text for text, ok in report["checks"] if not ok]
    assert code == 1 and failed == ["qwen3-4b fp8 holding 48 streams (gw-128): tok_s 0.875x knee's, within 10%"]

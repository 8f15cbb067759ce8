"""`make bench` (tests/benchmarks/peers/run.py) runs each of its options through to its table: with --dry-run
nothing is installed, started or loaded, so every option's path through `main` (the columns it adds, the
ratios and targets it prints, the JSON it writes) runs here in a second, and a crash in one of them (a name
shadowed in `main`, a column mistyped) fails `make test` instead of the end of a ten-minute benchmark."""

import json

import pytest

from tests.benchmarks.peers import run

SWITCHES = sorted(
    option for action in run.parser()._actions if action.nargs == 0 and action.const is True
    for option in action.option_strings if option.startswith("--") and option != "--dry-run"
)
COLUMNS = {  # the column each comparison adds to the table
    "--knobs": [label for label, _, _ in run.KNOBS],
    "--routing-compare": [label for label, _ in run.ROUTING_COMPARE],
    "--store-compare": [label for label, _ in run.STORE_COMPARE],
    "--ledger-compare": [label for label, _ in run.LEDGER_COMPARE],
    "--tracing-compare": [run.TRACED],
    "--variants-compare": [run.VARIANTS],
    "--edge-compare": [run.PLAIN_EDGE],
}


def dry_run(tmp_path, capsys, *argv: str) -> tuple[str, dict]:
    out = tmp_path / "results.json"
    assert run.main(["--dry-run", "--rounds", "2", "--out", str(out), *argv]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_every_switch_has_its_path_checked():
    assert set(COLUMNS) <= set(SWITCHES) and "--no-soak" in SWITCHES  # the list is read from the parser itself


@pytest.mark.parametrize("switch", SWITCHES)
def test_each_switch_runs_to_its_table(switch, tmp_path, capsys):
    printed, results = dry_run(tmp_path, capsys, switch)
    assert "| figure (median of rounds) |" in printed and "whole run" in printed
    assert results["args"][switch[2:].replace("-", "_")] is True
    for column in COLUMNS.get(switch, []):
        assert column in results["samples"] and len(results["samples"][column]["rps"]) == 2
        assert f"{column}" in printed


def test_all_switches_and_a_subset_of_systems_at_once(tmp_path, capsys):
    printed, results = dry_run(tmp_path, capsys, *SWITCHES, "--systems", "gateway,nginx")
    assert "LiteLLM" not in results["samples"] and "nginx" in results["samples"]
    assert "within 10% of least-in-flight" in printed and "tracing at ratio 1.0" in printed
    assert results["soak"] is None and results["profile"] is None and results["ceilings"] == []


def test_the_default_run_prints_targets_soak_profile_and_ceilings(tmp_path, capsys):
    printed, results = dry_run(tmp_path, capsys)
    assert {t["target"] for t in results["targets"]} >= {"requests/s >= 20x LiteLLM", "added p50 at c=1 <= 0.5 ms"}
    assert "gateway soak" in printed and "gateway profile under c=64" in printed and "ceilings:" in printed
    assert "where the gateway's" in printed  # the CPU breakdown by the ceilings


def test_a_baseline_tree_is_a_column_held_to_three_percent(tmp_path, capsys):
    printed, results = dry_run(tmp_path, capsys, "--baseline-tree", str(tmp_path))
    assert len(results["samples"][run.BASELINE]["rps"]) == 2
    assert "this tree within 3% of the baseline tree" in printed


def test_the_streams_comparison_refuses_what_would_do_nothing_or_set_nothing(capsys):
    from tests.benchmarks.peers import streams_ab

    args = streams_ab.parse_args(["--baseline-tree", "/tmp/x", "--plain-first", "5", "--env-this", "A=1=2"])
    assert (args.rounds, args.plain_first, args.env_this) == (6, 5.0, ["A=1=2"])
    for argv in (["--rounds", "0"], ["--env-this", "NOVALUE"]):
        with pytest.raises(SystemExit):
            streams_ab.parse_args(["--baseline-tree", "/tmp/x", *argv])
    assert "nothing to do" in capsys.readouterr().err

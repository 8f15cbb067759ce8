import pytest

from gateway.cli import main
from policies.config import PolicyError, parse_policy

GOOD = """
listen: {host: 127.0.0.1, port: 9000}
timeouts: {connect: 2, read: 30}
models:
  - name: qwen3-4b
    aliases: [qwen]
    served_name: Qwen/Qwen3-4B
    backends:
      - url: http://10.0.0.1:8000/
      - url: http://10.0.0.2:8000
        name: gpu-2
  - name: embed
    backends: [{url: "http://127.0.0.1:8001"}]
"""


def test_good_policy_parses_with_defaults():
    policy = parse_policy(GOOD)
    assert policy.listen.port == 9000
    assert policy.timeouts.connect == 2 and policy.timeouts.health_check == 2.0
    assert policy.models[0].backends[0].url == "http://10.0.0.1:8000"
    assert [m.name for m in policy.models] == ["qwen3-4b", "embed"]
    assert policy.server.drain_seconds == 0 and policy.server.shutdown_timeout == 30


@pytest.mark.parametrize(
    "text, expected",
    [
        (GOOD.replace("aliases:", "alias:"), "models[0](name=qwen3-4b).alias: unknown field"),
        (GOOD.replace("http://10.0.0.2:8000", "10.0.0.2:8000"), "models[0](name=qwen3-4b).backends[1](name=gpu-2).url"),
        (GOOD.replace("port: 9000", "port: 99999"), "listen.port"),
        (GOOD.replace("connect: 2", "connect: -1"), "timeouts.connect"),
        (GOOD.replace("[qwen]", "[embed]"), "'embed' is used twice"),
        (GOOD.replace("name: gpu-2", "name: qwen3-4b-0"), "backend name 'qwen3-4b-0' is used twice"),
        (GOOD + "server: {drain_seconds: -1}\n", "server.drain_seconds"),
        (GOOD + "server: {shutdown_timeout: 0}\n", "server.shutdown_timeout"),
        ("models: []", "models: List should have at least 1 item"),
        ("listen: {port: 1}\n", "models: required field is missing"),
        ("models:\n  - name: a\n    name: b\n", "duplicate key 'name'"),
        ("models: [", "not valid YAML"),
        ("- a\n", "must be a mapping"),
        (GOOD + "routing: {profiles: {p: {scorers: [{name: fastest}]}}}\n", "unknown scorer 'fastest'"),
        (GOOD + "routing: {profiles: {p: {scorers: [{name: prefix-affinity, params: {imbalance: 0}}]}}}\n",
         "prefix-affinity: params: imbalance: Input should be greater than or equal to 1"),
        (GOOD + "routing: {default_profile: nope}\n", "default_profile 'nope' is not a profile"),
        (GOOD.replace("    backends:", "    routing: nope\n    backends:", 1), "routing profile 'nope' is not defined"),
    ],
)
def test_bad_policy_names_the_field(text, expected):
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    assert expected in str(info.value)


def test_check_command(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    assert main(["check", str(good)]) == 0
    assert "ok (2 models, 3 backends)" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("served_name:", "servedname:"))
    assert main(["check", str(bad)]) == 1
    assert "models[0](name=qwen3-4b).servedname: unknown field" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["health", "/health?x=1", "/a b"])
def test_health_path_is_a_plain_absolute_path(path):
    with pytest.raises(PolicyError, match="health_path"):
        parse_policy(f"models: [{{name: m, backends: [{{url: 'http://10.0.0.1', health_path: '{path}'}}]}}]")

"""The routing benchmark's external-servers mode (tests/benchmarks/routing.py --servers) takes loopback servers
only, names them by port, and runs the gateway as told or as this interpreter can."""

import sys
from pathlib import Path

import pytest

from tests.benchmarks.routing import ExternalServer, gateway_command, parse_args


def test_external_servers_are_named_by_port_and_logs_pair_with_them():
    args = parse_args(["--servers", "http://127.0.0.1:8000,http://127.0.0.1:8001/", "--served-model", "qwen3-4b",
                       "--server-logs", "a.log,b.log"])
    servers = [ExternalServer(u, log) for u, log in zip(args.servers, args.server_logs)]
    assert [s.label for s in servers] == ["vllm-8000", "vllm-8001"]
    assert servers[1].base_url == "http://127.0.0.1:8001" and servers[0].log_path == Path("a.log")
    assert args.served_model == "qwen3-4b"


def test_external_servers_name_their_kv_event_ports_for_the_precise_prefix_profile():
    args = parse_args(["--servers", "http://127.0.0.1:8000,http://127.0.0.1:8001", "--profiles",
                       "prefix-affinity,precise-prefix", "--kv-events-ports", "5557,5558"])
    assert args.kv_events_ports == [5557, 5558] and args.profiles == ["prefix-affinity", "precise-prefix"]


def test_without_logs_the_server_logs_are_none():
    args = parse_args(["--servers", "http://127.0.0.1:8000,http://localhost:8001"])
    assert args.server_logs == [None, None]
    assert ExternalServer(args.servers[0]).log_text() == ""


@pytest.mark.parametrize("argv", [
    ["--servers", "http://10.0.0.5:8000,http://127.0.0.1:8001"],  # not loopback
    ["--servers", "http://127.0.0.1,http://127.0.0.1:8001"],  # no port
    ["--servers", "http://127.0.0.1:8000"],  # one server
    ["--servers", "http://127.0.0.1:8000,http://127.0.0.1:8001", "--server-logs", "a.log"],  # one log for two
    ["--server-logs", "a.log"],  # logs without servers
    # the precise-prefix profile on external servers without their KV event ports
    ["--servers", "http://127.0.0.1:8000,http://127.0.0.1:8001", "--profiles", "precise-prefix"],
    ["--servers", "http://127.0.0.1:8000,http://127.0.0.1:8001", "--profiles", "precise-prefix",
     "--kv-events-ports", "5557"],
])
def test_bad_external_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err


def test_the_gateway_command_is_the_one_given_else_what_this_interpreter_has():
    assert gateway_command(parse_args(["--gateway-cmd", "python3 -m gateway"])) == ["python3", "-m", "gateway"]
    default = gateway_command(parse_args([]))
    cli = Path(sys.executable).with_name("llm-gateway")
    assert default == ([str(cli)] if cli.exists() else [sys.executable, "-m", "gateway"])

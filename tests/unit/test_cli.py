"""`llm-gateway`'s dispatch: every command's parser names the function that runs it (`set_defaults(run=...)`),
and `main` returns what that function returns."""

from __future__ import annotations

import argparse
import socket

import pytest

from gateway.cli import main
from gateway.reference_docs import cli_parser, subcommands

COMMANDS = ["serve", "check", "demo", "admin-token", "keys", "audit", "knee", "report", "teams", "variants"]
GOOD = "models:\n  - name: chat\n    backends:\n      - url: http://10.0.0.1:8000\n"


def test_every_command_names_its_run_function():
    sub, _ = subcommands(cli_parser())
    assert sub is not None and list(sub.choices) == COMMANDS
    for name, parser in sub.choices.items():
        assert callable(parser.get_default("run")), f"`{name}` has no run default"


def test_check_dispatches_and_returns_its_status(tmp_path, capsys):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD)
    bad.write_text(GOOD.replace("backends:", "backend:"))
    assert main(["check", str(good)]) == 0
    assert "ok (1 models, 1 backends)" in capsys.readouterr().out
    assert main(["check", "--no-resolve", str(bad)]) == 1
    assert "backend: unknown field" in capsys.readouterr().err


@pytest.mark.parametrize("argv, mint", [
    (["keys", "list"], "(mint one with `llm-gateway admin-token`)"),
    (["teams", "list"], "(mint one with `llm-gateway admin-token`)"),
    (["report"], "(mint one with `llm-gateway admin-token --role viewer`)"),
    (["audit"], "(mint one with `llm-gateway admin-token --role viewer`)"),
    (["variants"], "(mint one with `llm-gateway admin-token --role viewer`)"),
])
def test_admin_commands_without_a_token_exit_2(argv, mint, monkeypatch, capsys):
    monkeypatch.delenv("LLM_GATEWAY_ADMIN_TOKEN", raising=False)
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"{argv[0]}: an admin token is needed: --token or $LLM_GATEWAY_ADMIN_TOKEN "
                                       f"{mint}\n")


def closed_port() -> int:
    """A loopback port that nothing listens on (bound, then closed): a connection there is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.mark.parametrize("argv", [["keys", "list"], ["teams", "show", "t1"], ["report"], ["audit"], ["variants"]])
def test_admin_commands_say_when_the_gateway_cannot_be_reached(argv, capsys):
    url = f"http://127.0.0.1:{closed_port()}"
    assert main([argv[0], "--url", url, "--token", "secret-token", *argv[1:]]) == 1
    err = capsys.readouterr().err
    assert f"{argv[0]}: cannot reach the gateway at {url}: ConnectError" in err
    assert "secret-token" not in err


def test_main_returns_what_the_run_function_returns(monkeypatch):
    seen: list[argparse.Namespace] = []

    def fake_check(path: str, resolve: bool = True) -> int:
        seen.append(argparse.Namespace(path=path, resolve=resolve))
        return 7

    monkeypatch.setattr("gateway.cli.run_check", fake_check)
    assert main(["check", "--no-resolve", "p.yaml"]) == 7
    assert seen == [argparse.Namespace(path="p.yaml", resolve=False)]


@pytest.mark.parametrize("body", [b'{"error": {"message": "no such key"}}', b'{"error": "boom"}', b"<html>oops</html>"])
def test_an_error_answer_is_reported_whatever_its_shape(body, monkeypatch, capsys):
    """keys (send) and report (admin_get) say the gateway's message, or the answer's text when it has none of
    the expected shape, and exit 1; never a traceback."""
    import httpx

    answer = httpx.Response(500, content=body, request=httpx.Request("GET", "http://127.0.0.1:9/"))
    monkeypatch.setattr(httpx, "request", lambda *a, **k: answer)
    monkeypatch.setattr(httpx, "get", lambda *a, **k: answer)
    expected = "no such key" if b"no such key" in body else body.decode()
    for argv in (["keys", "--token", "t", "list"], ["report", "--token", "t"]):
        assert main(argv) == 1
        assert f"HTTP 500: {expected}" in capsys.readouterr().err

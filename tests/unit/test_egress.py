"""Egress rules: the load-time check of every backend and provider, and the connect-time guard under the upstream client."""

from __future__ import annotations

import asyncio
import ipaddress
import logging

import pytest

from backends.egress import EgressRefused, GuardedDialer, SystemResolver
from backends.http1 import ConnectFailed
from backends.upstream import CONNECT, new_client
from gateway.cli import main
from policies.config import Policy, PolicyError
from policies.egress import check_backends


class FakeDNS:
    """Answers from a dict; a missing name does not resolve; counts lookups so literals can be shown to skip it."""

    def __init__(self, answers: dict[str, list[str]] | None = None, delay: float = 0.0) -> None:
        self.answers = answers or {}
        self.delay = delay
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if self.delay:
            await asyncio.sleep(self.delay)
        if host not in self.answers:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return list(self.answers[host])


def policy(*urls: str, providers: list[dict] | None = None, **extra) -> Policy:
    return Policy.model_validate({
        "models": [{"name": "chat", "backends": [{"url": u} for u in urls]}],
        "providers": providers or [],
        **extra,
    })


def provider(base_url: str, **extra) -> dict:
    return {"name": "rent", "base_url": base_url, "api_key_env": "RENT_KEY", "models": {"chat": "gpt"}, **extra}


async def refused(p: Policy, dns: FakeDNS | None = None, **kw) -> str:
    with pytest.raises(PolicyError) as info:
        await check_backends(p, dns or FakeDNS(), **kw)
    return str(info.value)


# --- load time ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://172.31.255.1", "https://192.168.1.2:8443",
                                 "http://127.0.0.1:8000", "http://[::1]:8000", "http://[fd12:3456::1]:8000",
                                 "http://[::ffff:10.0.0.1]:8000"])
async def test_private_ip_literals_pass_without_dns(url):
    dns = FakeDNS()
    await check_backends(policy(url), dns)
    assert dns.asked == []


@pytest.mark.parametrize("url, address", [
    ("http://8.8.8.8:8000", "8.8.8.8"),
    ("http://172.32.0.1:8000", "172.32.0.1"),  # just outside 172.16.0.0/12
    ("http://[2001:4860:4860::8888]:8000", "2001:4860:4860::8888"),
    ("http://[::ffff:8.8.8.8]:8000", "::ffff:8.8.8.8"),  # IPv4-mapped: judged as the IPv4 address it carries
    ("http://0.0.0.0:8000", "0.0.0.0"),
])
async def test_public_ip_literal_is_refused_naming_model_backend_and_address(url, address):
    message = await refused(policy("http://10.0.0.1:8000", url))
    assert "models[0](name=chat).backends[1](name=chat-1)" in message
    assert f"public address {address}" in message and url in message
    assert "backends[0]" not in message


async def test_a_public_tracing_collector_is_refused_when_tracing_is_on():
    collector = {"endpoint": "https://8.8.8.8:4318/v1/traces"}
    await check_backends(policy("http://10.0.0.1:8000", tracing=collector), FakeDNS())  # off: not used
    message = await refused(policy("http://10.0.0.1:8000", tracing={**collector, "enabled": True}))
    assert "tracing.endpoint" in message and "public address 8.8.8.8" in message


async def test_hostname_resolving_privately_passes():
    dns = FakeDNS({"vllm-a.internal": ["10.1.2.3"], "vllm-b.internal": ["fd00::7", "192.168.0.9"]})
    await check_backends(policy("http://vllm-a.internal:8000", "http://vllm-b.internal:8000"), dns)
    assert sorted(dns.asked) == ["vllm-a.internal", "vllm-b.internal"]


async def test_hostname_with_any_public_record_is_refused():
    dns = FakeDNS({"mixed.internal": ["10.1.2.3", "93.184.216.34", "fd00::1"]})
    message = await refused(policy("http://mixed.internal:8000"), dns)
    assert "public address 93.184.216.34" in message
    assert "10.1.2.3" not in message


async def test_hostname_resolving_to_public_ipv6_is_refused():
    dns = FakeDNS({"v6.internal": ["2606:2800:220:1::1"]})
    assert "public address 2606:2800:220:1::1" in await refused(policy("http://v6.internal:8000"), dns)


async def test_private_cidrs_are_configurable():
    p = policy("http://100.64.3.4:8000", "http://10.0.0.1:8000", network={"private_cidrs": ["100.64.0.0/10"]})
    message = await refused(p)
    assert "10.0.0.1" in message and "100.64.3.4" not in message


async def test_unresolvable_host_is_an_error_with_a_clear_message():
    message = await refused(policy("http://typo.internal:8000"))
    assert "models[0](name=chat).backends[0](name=chat-0)" in message
    assert "cannot resolve host 'typo.internal'" in message


async def test_unresolvable_host_only_logs_when_not_fatal(caplog):
    with caplog.at_level(logging.WARNING, logger="gateway.egress"):
        await check_backends(policy("http://typo.internal:8000"), FakeDNS(), unresolved_fatal=False)
    assert "cannot resolve host 'typo.internal'" in caplog.text


async def test_unresolvable_never_hides_a_public_backend():
    p = policy("http://typo.internal:8000", "http://8.8.8.8:8000")
    message = await refused(p, unresolved_fatal=False)
    assert "8.8.8.8" in message and "typo.internal" not in message


async def test_slow_resolution_is_bounded_by_the_connect_timeout():
    dns = FakeDNS({"slow.internal": ["10.0.0.1"]}, delay=5)
    message = await asyncio.wait_for(refused(policy("http://slow.internal:8000", timeouts={"connect": 0.05}), dns), 2)
    assert "timed out" in message


async def test_rented_provider_on_public_address_is_exempt():
    dns = FakeDNS({"api.rented.example": ["93.184.216.34", "2606:2800:220:1::1"]})
    p = policy("http://10.0.0.1:8000", providers=[provider("https://api.rented.example/v1")])
    assert await check_backends(p, dns) == []  # passes, and nothing was left unchecked
    assert dns.asked == ["api.rented.example"]  # the provider was resolved and judged, not skipped
    # the same addresses behind an owned backend are refused: the exemption is the provider's
    message = await refused(policy("https://api.rented.example/v1"), dns)
    assert "public address 93.184.216.34, 2606:2800:220:1::1" in message


@pytest.mark.parametrize("address", ["127.0.0.1", "10.0.0.8", "169.254.169.254", "fd00::5", "::1"])
async def test_provider_on_private_address_is_refused_unless_allowed(address):
    dns = FakeDNS({"api.rented.example": [address]})
    p = policy("http://10.0.0.1:8000", providers=[provider("https://api.rented.example/v1")])
    message = await refused(p, dns)
    assert "providers[0](name=rent)" in message and f"private address {address}" in message
    assert "allow_private_address" in message
    allowed = policy("http://10.0.0.1:8000", providers=[provider("https://api.rented.example/v1",
                                                                 allow_private_address=True)])
    await check_backends(allowed, dns)


async def test_every_problem_is_reported_at_once():
    dns = FakeDNS({"pub.internal": ["8.8.4.4"], "api.rented.example": ["127.0.0.1"]})
    p = policy("http://pub.internal:1", "http://1.1.1.1:1", "http://gone.internal:1",
               providers=[provider("http://api.rented.example/v1")])
    lines = (await refused(p, dns, source="policy.yaml")).splitlines()
    assert lines[0] == "policy.yaml: egress check failed"
    assert len(lines) == 5
    expected = [("backends[0]", "public address 8.8.4.4"), ("backends[1]", "public address 1.1.1.1"),
                ("providers[0]", "private address 127.0.0.1"), ("backends[2]", "cannot resolve host 'gone.internal'")]
    for line, (what, why) in zip(lines[1:], expected, strict=True):
        assert what in line and why in line, line


def test_cli_check_reports_egress_errors_and_exits_1(tmp_path, capsys):
    path = tmp_path / "policy.yaml"
    path.write_text("models:\n  - name: chat\n    backends:\n      - url: http://8.8.8.8:8000\n")
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}: egress check failed") and "public address 8.8.8.8" in err
    path.write_text("models:\n  - name: chat\n    backends:\n      - url: http://10.0.0.1:8000\n")
    assert main(["check", str(path)]) == 0


def test_cli_check_no_resolve_checks_literals_offline_and_names_what_it_skipped(tmp_path, capsys):
    path = tmp_path / "policy.yaml"
    path.write_text("models:\n  - name: chat\n    backends:\n      - url: http://vllm.nowhere.invalid:8000\n"
                    "      - url: http://10.0.0.2:8000\n")
    assert main(["check", str(path)]) == 1  # resolving: the name does not resolve
    capsys.readouterr()
    assert main(["check", "--no-resolve", str(path)]) == 0
    assert "not checked against the egress rules: vllm.nowhere.invalid" in capsys.readouterr().out
    path.write_text("models:\n  - name: chat\n    backends:\n      - url: http://vllm.nowhere.invalid:8000\n"
                    "      - url: http://8.8.8.8:8000\n")
    assert main(["check", "--no-resolve", str(path)]) == 1  # a public literal is refused offline too
    assert "public address 8.8.8.8" in capsys.readouterr().err


def test_cli_serve_refuses_a_public_backend_before_listening(tmp_path, capsys):
    path = tmp_path / "policy.yaml"
    path.write_text("models:\n  - name: chat\n    backends:\n      - url: http://8.8.8.8:8000\n")
    assert main(["serve", "--config", str(path)]) == 1
    assert "public address 8.8.8.8" in capsys.readouterr().err


# --- connect time -------------------------------------------------------------------------------------------


class FakeSockets:
    """A dialer that records every connection asked for (and the TLS server name); `dead` addresses refuse."""

    def __init__(self, dead: tuple[str, ...] = ()) -> None:
        self.log: list = []
        self.dead = dead

    async def dial(self, host, port, *, tls, server_name, timeout, factory):
        self.log.append(("connect", host, port))
        if tls:
            self.log.append(("start_tls", server_name))
        if host in self.dead:
            raise ConnectFailed("connection refused")
        return "connection"


def guarded(dns: FakeDNS, sockets: FakeSockets, exempt=(), on_refused=None) -> GuardedDialer:
    return GuardedDialer(["10.0.0.0/8", "127.0.0.0/8", "fd00::/8"], dns, exempt, on_refused, inner=sockets)


async def dial(dialer, host: str, port: int, tls: bool = False, timeout: float | None = None):
    return await dialer.dial(host, port, tls=tls, server_name=host, timeout=timeout, factory=None)


async def test_guard_connects_to_the_checked_address():
    sockets = FakeSockets()
    await dial(guarded(FakeDNS({"vllm.internal": ["10.0.0.7"]}), sockets), "vllm.internal", 8000)
    assert sockets.log == [("connect", "10.0.0.7", 8000)]


async def test_guard_refuses_a_public_answer_before_any_connection(caplog):
    sockets, seen = FakeSockets(), []
    network = guarded(FakeDNS({"vllm.internal": ["10.0.0.7", "203.0.113.9"]}), sockets,
                      on_refused=lambda *args: seen.append(args))
    with caplog.at_level(logging.WARNING, logger="gateway.egress"), pytest.raises(EgressRefused):
        await dial(network, "vllm.internal", 8000)
    assert sockets.log == []
    assert seen == [("vllm.internal", 8000, "203.0.113.9")]
    assert "refused: backend vllm.internal:8000 resolved to public address 203.0.113.9" in caplog.text


async def test_guard_checks_ip_literals_without_dns():
    dns, sockets = FakeDNS(), FakeSockets()
    with pytest.raises(EgressRefused):
        await dial(guarded(dns, sockets), "198.51.100.1", 80)
    await dial(guarded(dns, sockets), "10.9.9.9", 80)
    assert dns.asked == [] and sockets.log == [("connect", "10.9.9.9", 80)]


async def test_guard_tries_the_next_checked_address_when_one_is_down():
    sockets = FakeSockets(dead=("10.0.0.1",))
    dns = FakeDNS({"vllm.internal": ["10.0.0.1", "fd00::2"]})
    await dial(guarded(dns, sockets), "vllm.internal", 8000, timeout=1)
    assert sockets.log == [("connect", "10.0.0.1", 8000), ("connect", "fd00::2", 8000)]


async def test_guard_unresolvable_host_is_a_connect_error():
    with pytest.raises(ConnectFailed, match="cannot resolve gone.internal") as info:
        await dial(guarded(FakeDNS(), FakeSockets()), "gone.internal", 8000)
    assert info.value.kind == CONNECT


async def test_rented_origin_is_exempt_and_resolved_as_usual():
    sockets, dns = FakeSockets(), FakeDNS()
    network = guarded(dns, sockets, exempt=[("API.Rented.example", 443)])
    await dial(network, "api.rented.example", 443)
    assert sockets.log == [("connect", "api.rented.example", 443)] and dns.asked == []
    with pytest.raises(ConnectFailed):  # the same host on another port is not the declared provider
        await dial(network, "api.rented.example", 8443)


async def test_client_refusal_is_a_connect_failure_and_tls_keeps_the_hostname():
    dns = FakeDNS({"vllm.internal": ["203.0.113.5"]})
    client = new_client(1, 1, private_cidrs=["10.0.0.0/8"], resolver=dns)
    with pytest.raises(ConnectFailed) as info:
        await client.get("http://vllm.internal:8000/health")
    assert info.value.kind == CONNECT and "203.0.113.5" in str(info.value)

    sockets = FakeSockets(dead=("10.0.0.9",))
    client = new_client(1, 1, private_cidrs=["10.0.0.0/8"], resolver=FakeDNS({"vllm.internal": ["10.0.0.9"]}))
    client.dialer.inner = sockets  # swap in the recorder under the real client
    with pytest.raises(ConnectFailed):
        await client.get("https://vllm.internal:8443/health")
    assert sockets.log == [("connect", "10.0.0.9", 8443), ("start_tls", "vllm.internal")]


async def test_default_client_is_unguarded():
    assert not isinstance(new_client(1, 1).dialer, GuardedDialer)


async def test_system_resolver_answers_for_localhost():
    addresses = await SystemResolver().resolve("localhost", 80)
    assert addresses and all(ipaddress.ip_address(a).is_loopback for a in addresses)

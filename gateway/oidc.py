"""The signing keys of the admins' OpenID provider: its discovery document, then its JWKS, cached and refreshed.

Fetched with the async HTTP client, so the event loop never waits on the provider; each fetch is bounded in
time (`fetch_timeout_seconds` for the discovery document and the JWKS together) and size (`max_document_bytes`
each). One fetch runs at a time; callers that need it meanwhile wait for that one.

    a known kid, keys younger than refresh_seconds     verify with the cached key
    a known kid, keys older than refresh_seconds       verify with the cached key; a refresh starts beside
    a known kid, no good fetch for max_stale_seconds   refetch now; still failing: refuse (fail closed)
    an unknown kid                                     refetch now, at most once per unknown_kid_refetch_seconds;
                                                       still unknown, or the provider unreachable: refuse

A key the provider removed stops verifying at the first refresh that no longer lists it: rotation at the
provider is followed within refresh_seconds, or at once when a token signed with the new key arrives first.
Parsing is PyJWT's (PyJWKSet); keys whose algorithm the policy does not allow are dropped.

The console's sign-in at the provider (gateway/console/sso.py) takes the authorization and token endpoints from
the same discovery document (`endpoint`) and exchanges its code at the token endpoint (`exchange`), within the
same bounds of time and size.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import ssl
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import jwt

from policies.config.oidc import AdminOidc, secure_url

log = logging.getLogger("gateway.oidc")


class KeysUnavailable(Exception):
    """The provider's keys could not be fetched; the message names the step, never a response body."""


class CodeRefused(Exception):
    """The token endpoint refused a code; the message is the provider's OAuth error code, never its body."""


ENDPOINTS = ("authorization_endpoint", "token_endpoint")
ERROR_CODE = re.compile(r"[a-z_]{1,64}")


class IssuerKeys:
    def __init__(self, settings: AdminOidc, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.keys: dict[str, jwt.PyJWK] = {}
        self.fetched_at: float | None = None  # the last fetch that succeeded (clock's time)
        self.tried_at: float | None = None  # the last fetch, failed or not
        self.error: str | None = None  # why the last fetch failed; None after a success
        self.jwks_uri: str | None = None
        self.endpoints: dict[str, str] = {}  # the discovery document's ENDPOINTS that are secure URLs
        self.auth_methods: list[str] = []  # its token_endpoint_auth_methods_supported
        self.lock = asyncio.Lock()
        self.refreshing: asyncio.Task[None] | None = None
        self.fetches = 0  # fetches started, for the tests and the logs

    async def key(self, kid: str) -> jwt.PyJWK:
        """The key that verifies tokens with this `kid`; KeyError (with the reason) when there is none to trust."""
        now = self.clock()
        age = None if self.fetched_at is None else now - self.fetched_at
        if kid in self.keys and age is not None and age <= self.settings.max_stale_seconds:
            if age >= self.settings.refresh_seconds:
                self.refresh_beside(now)
            return self.keys[kid]
        # unknown kid, or keys too old to trust: a fetch now (rate-limited), then decide
        if self.may_fetch(now):
            await self.refresh()
        elif self.lock.locked():  # a fetch is under way (at startup, or another caller's): its outcome decides
            async with self.lock:
                pass
        age = None if self.fetched_at is None else self.clock() - self.fetched_at
        if age is not None and age <= self.settings.max_stale_seconds and kid in self.keys:
            return self.keys[kid]
        if self.error is not None and kid not in self.keys:
            raise KeyError(f"the token's signing key is unknown and the issuer's keys cannot be fetched now"
                           f" ({self.error}); refused until they can")
        if kid in self.keys:
            raise KeyError(f"the issuer's keys could not be refreshed for over {self.settings.max_stale_seconds:g} s"
                           f" ({self.error}); refused until they can")
        raise KeyError("the token's signing key (kid) is not among the issuer's keys")

    def may_fetch(self, now: float) -> bool:
        return self.tried_at is None or now - self.tried_at >= self.settings.unknown_kid_refetch_seconds

    def refresh_beside(self, now: float) -> None:
        if (self.refreshing is None or self.refreshing.done()) and self.may_fetch(now):
            self.refreshing = asyncio.create_task(self.refresh())

    async def refresh(self) -> None:
        """Fetch the keys once (a caller arriving during a fetch waits for it instead of starting another)."""
        started = self.clock()
        async with self.lock:
            if self.tried_at is not None and self.tried_at >= started:
                return  # another caller fetched while this one waited
            self.tried_at = self.clock()
            self.fetches += 1
            try:
                async with asyncio.timeout(self.settings.fetch_timeout_seconds):
                    keys = await self.fetch()
            except (KeysUnavailable, TimeoutError) as exc:
                self.jwks_uri = None  # the next fetch reads the discovery document again: it may have moved
                self.error = str(exc) or f"no answer in {self.settings.fetch_timeout_seconds:g} s"
                log.warning("admin OIDC: the keys of %s could not be fetched: %s", self.settings.issuer, self.error)
                return
            dropped = self.keys.keys() - keys.keys()
            self.keys, self.fetched_at, self.error = keys, self.clock(), None
            log.info("admin OIDC: %d signing keys of %s%s", len(keys), self.settings.issuer,
                     f" ({len(dropped)} no longer listed)" if dropped else "")

    async def fetch(self) -> dict[str, jwt.PyJWK]:
        """Discovery (once), then the JWKS. The caller bounds the whole; httpx's own bound is looser, so the
        message says the whole timed out rather than which read did."""
        async with httpx.AsyncClient(verify=self.tls(), follow_redirects=False, trust_env=False,
                                     timeout=self.settings.fetch_timeout_seconds + 1) as client:
            if self.jwks_uri is None:
                discovery = await self.document(client, self.settings.issuer.rstrip("/")
                                                + "/.well-known/openid-configuration", "discovery document")
                if discovery.get("issuer") != self.settings.issuer:
                    raise KeysUnavailable("the discovery document names another issuer")
                self.endpoints, self.auth_methods = endpoints(discovery)
                uri = discovery.get("jwks_uri")
                if not isinstance(uri, str):
                    raise KeysUnavailable("the discovery document has no jwks_uri")
                try:
                    self.jwks_uri = secure_url(uri, "the provider's jwks_uri")
                except ValueError as exc:
                    raise KeysUnavailable(str(exc)) from None
            jwks = await self.document(client, self.jwks_uri, "JWKS")
        listed = jwks.get("keys")
        if not isinstance(listed, list):
            raise KeysUnavailable("the JWKS has no list of keys")
        signing = [k for k in listed if isinstance(k, dict) and k.get("use", "sig") == "sig"]
        try:
            found = jwt.PyJWKSet(signing).keys
        except jwt.PyJWTError as exc:
            raise KeysUnavailable(f"the JWKS has no usable key: {type(exc).__name__}") from None
        allowed = set(self.settings.algorithms)
        return {k.key_id: k for k in found if k.key_id and k.algorithm_name in allowed}

    async def document(self, client: httpx.AsyncClient, url: str, what: str) -> dict[str, Any]:
        _, data = await self.read_json(client.stream("GET", url, headers={"accept": "application/json"}), what,
                                            only_ok=True)
        return data

    async def read_json(self, request: AbstractAsyncContextManager[httpx.Response], what: str, only_ok: bool) -> tuple[int, dict[str, Any]]:
        """The status and JSON object of a response, at most max_document_bytes read (`only_ok`: refuse any
        status but 200 before reading)."""
        limit = self.settings.max_document_bytes
        try:
            async with request as response:
                if only_ok and response.status_code != 200:
                    raise KeysUnavailable(f"the {what} answered HTTP {response.status_code}")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise KeysUnavailable(f"the {what} is over {limit} bytes")
        except httpx.HTTPError as exc:
            raise KeysUnavailable(f"the {what} cannot be reached: {type(exc).__name__}") from None
        try:
            data = json.loads(body)
        except ValueError:
            raise KeysUnavailable(f"the {what} is not JSON") from None
        if not isinstance(data, dict):
            raise KeysUnavailable(f"the {what} is not a JSON object")
        return response.status_code, data

    async def endpoint(self, name: str) -> str:
        """The provider's `name` (one of ENDPOINTS) from its discovery document, read again now (at most once per
        unknown_kid_refetch_seconds) if the last reading had none; KeysUnavailable when there is none to use."""
        if name not in self.endpoints:
            if self.may_fetch(self.clock()):
                self.jwks_uri = None  # so the fetch reads the discovery document again
                await self.refresh()
            elif self.lock.locked():
                async with self.lock:
                    pass
        if name in self.endpoints:
            return self.endpoints[name]
        raise KeysUnavailable(self.error or f"the discovery document has no {name} (https, or http on loopback)")

    async def exchange(self, form: dict[str, str], auth: tuple[str, str] | None) -> dict[str, Any]:
        """The token endpoint's answer to `form` (an authorization code grant), with HTTP Basic client `auth` if
        given (client_secret_basic, the default of OAuth; client_secret_post where the provider lists only that).
        CodeRefused with the provider's error code, KeysUnavailable when it cannot be asked or answers no JSON."""
        url = await self.endpoint("token_endpoint")
        if auth is not None and "client_secret_basic" not in self.auth_methods and \
                "client_secret_post" in self.auth_methods:
            form, auth = {**form, "client_id": auth[0], "client_secret": auth[1]}, None
        try:
            async with asyncio.timeout(self.settings.fetch_timeout_seconds), \
                    httpx.AsyncClient(verify=self.tls(), follow_redirects=False, trust_env=False,
                                      timeout=self.settings.fetch_timeout_seconds + 1) as client:
                basic = httpx.BasicAuth(*auth) if auth is not None else None
                request = client.stream("POST", url, data=form, auth=basic, headers={"accept": "application/json"})
                status, data = await self.read_json(request, "token endpoint", only_ok=False)
        except TimeoutError:
            raise KeysUnavailable(f"the token endpoint gave no answer in {self.settings.fetch_timeout_seconds:g} s") \
                from None
        if status != 200:
            error = data.get("error")
            raise CodeRefused(error if isinstance(error, str) and ERROR_CODE.fullmatch(error)
                              else f"HTTP {status}")
        return data

    def tls(self) -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=self.settings.ca_file) if self.settings.ca_file else True

    async def close(self) -> None:
        if self.refreshing is not None:
            self.refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.refreshing


def endpoints(discovery: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """The console's endpoints from a discovery document (those not https, or http on loopback, left out: a
    provider without them still serves its keys) and the token endpoint's client authentication methods."""
    found = {}
    for name in ENDPOINTS:
        url = discovery.get(name)
        if isinstance(url, str):
            with contextlib.suppress(ValueError):
                found[name] = secure_url(url, name)
    methods = discovery.get("token_endpoint_auth_methods_supported")
    return found, [m for m in methods if isinstance(m, str)] if isinstance(methods, list) else []

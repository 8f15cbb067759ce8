"""A real OpenID provider for the tests: node-oidc-provider (installed by scripts/setup_oidc.sh into .cache/oidc)
run with tests/oidc/provider.mjs on a loopback port, with signing keys the test makes and may rotate.

The test holds the private keys, so besides asking the provider for tokens (client_credentials) it can sign
tokens the provider never would (a future `nbf`) with the provider's own key.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.support.needs import missing
from tests.support.probes import wait_http_ok
from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
MODULES = ROOT / ".cache" / "oidc" / "node_modules"
SCRIPT = ROOT / "tests" / "oidc" / "provider.mjs"


def signing_key(kid: str) -> tuple[rsa.RSAPrivateKey, dict]:
    """A new RSA key and its private JWK (what the provider signs with)."""
    private = rsa.generate_private_key(65537, 2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private))
    return private, {**jwk, "kid": kid, "alg": "RS256", "use": "sig"}


class OidcProvider:
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        if shutil.which("node") is None or not (MODULES / "oidc-provider").is_dir():
            missing("node and node-oidc-provider (.cache/oidc)", "oidc-setup")
        self.workdir = workdir
        self.port = port or free_port()
        self.issuer = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.keys: dict[str, rsa.RSAPrivateKey] = {}

    def start(self, kid: str) -> OidcProvider:
        """(Re)start the provider signing with key `kid` (made now unless it was before), the only one its JWKS
        lists."""
        self.stop()
        private = self.keys.get(kid)
        if private is None:
            private, jwk = signing_key(kid)
        else:
            jwk = {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private)), "kid": kid, "alg": "RS256", "use": "sig"}
        self.keys[kid] = private
        jwks = self.workdir / f"jwks-{self.port}-{kid}.json"
        jwks.write_text(json.dumps({"keys": [jwk]}))
        with open(self.workdir / f"provider-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen(["node", str(SCRIPT), str(self.port), str(jwks), str(MODULES)],
                                         stdout=log, stderr=subprocess.STDOUT)
        wait_http_ok(f"{self.issuer}/.well-known/openid-configuration", self.proc, 60, "the OpenID provider")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None

    def token(self, client: str, resource: str | None = None) -> str:
        """An access token of `client` (its groups in the `groups` claim) from the token endpoint."""
        form = {"grant_type": "client_credentials", "client_id": client, "client_secret": f"{client}-secret"}
        if resource:
            form["resource"] = resource
        reply = httpx.post(f"{self.issuer}/token", data=form, timeout=30)
        assert reply.status_code == 200, reply.text
        return reply.json()["access_token"]

    def sign(self, kid: str, **claims) -> str:
        """A token signed with the provider's key `kid`, with claims the provider would not give."""
        now = int(time.time())
        body = {"iss": self.issuer, "aud": "llm-gateway-admin", "sub": "forged", "iat": now, "exp": now + 600,
                "groups": ["gw-admins"], **claims}
        return jwt.encode({k: v for k, v in body.items() if v is not None}, self.keys[kid], algorithm="RS256",
                          headers={"kid": kid})

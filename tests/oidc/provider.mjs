// A real OpenID provider for the admin API's OIDC tests: node-oidc-provider (scripts/setup_oidc.sh pins it).
//
//   node tests/oidc/provider.mjs <port> <jwks file> <module dir>
//
// Serves the discovery document, the JWKS and the client_credentials grant on http://127.0.0.1:<port>.
// Each client stands for a group of people: its access tokens (JWT, signed with the first key of the JWKS
// file) carry its `groups`. Rotation is a restart with another JWKS file. Resources pick the audience and
// lifetime: urn:llm-gateway:admin (the gateway's audience, 10 min; the default), urn:llm-gateway:short
// (the gateway's audience, 2 s), urn:elsewhere (another audience).
// The console's sign-in (authorization code + PKCE) uses the clients `console` (a secret) and `console-public`
// (none), native, so a redirect to any loopback port is accepted; people log in at the development interaction
// (any password) under a name of USERS, whose groups their ID token carries.
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const [port, jwksFile, moduleDir] = process.argv.slice(2);
const { default: Provider } = await import(pathToFileURL(join(moduleDir, 'oidc-provider', 'lib', 'index.js')));

const GROUPS = {
  admins: ['gw-admins', 'everyone'],
  operators: ['gw-operators', 'everyone'],
  viewers: ['gw-viewers'],
  'team-a': ['team-a-admins', 'gw-viewers'],
  outsiders: ['everyone'],
};
const USERS = { alice: ['gw-admins'], olivia: ['gw-operators'], vera: ['gw-viewers'], tina: ['team-a-admins'],
  oscar: ['everyone'] };
const CONSOLE = { application_type: 'native', redirect_uris: ['http://127.0.0.1/console/oidc/callback'],
  grant_types: ['authorization_code'], response_types: ['code'] };
const RESOURCES = {
  'urn:llm-gateway:admin': { audience: 'llm-gateway-admin', ttl: 600 },
  'urn:llm-gateway:short': { audience: 'llm-gateway-admin', ttl: 2 },
  'urn:elsewhere': { audience: 'some-other-api', ttl: 600 },
};

const issuer = `http://127.0.0.1:${port}`;
const provider = new Provider(issuer, {
  jwks: JSON.parse(readFileSync(jwksFile, 'utf8')),
  clients: Object.keys(GROUPS).map((name) => ({
    client_id: name,
    client_secret: `${name}-secret`,
    grant_types: ['client_credentials'],
    redirect_uris: [],
    response_types: [],
    token_endpoint_auth_method: 'client_secret_post',
  })).concat([
    { ...CONSOLE, client_id: 'console', client_secret: 'console-secret' },
    { ...CONSOLE, client_id: 'console-public', token_endpoint_auth_method: 'none' },
  ]),
  claims: { openid: ['sub'], groups: ['groups'] },
  conformIdTokenClaims: false,
  findAccount: async (_ctx, id) => (USERS[id] ? { accountId: id, claims: async () => ({ sub: id, groups: USERS[id] }) }
                                                : undefined),
  features: {
    devInteractions: { enabled: true },
    clientCredentials: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: async () => 'urn:llm-gateway:admin',
      useGrantedResource: async () => true,
      getResourceServerInfo: async (_ctx, resource) => {
        const known = RESOURCES[resource];
        if (!known) throw new Provider.errors.InvalidTarget();
        return { scope: 'admin', audience: known.audience, accessTokenTTL: known.ttl, accessTokenFormat: 'jwt',
                 jwt: { sign: { alg: 'RS256' } } };
      },
    },
  },
  extraTokenClaims: async (_ctx, token) => ({ groups: GROUPS[token.clientId] }),
});
provider.listen(Number(port), '127.0.0.1', () => console.log(`listening ${issuer}`));

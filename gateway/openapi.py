"""The OpenAPI document at /schema: what the ops and admin routes accept and every answer they give.

Litestar writes most of it from the handlers' types; this module supplies what it cannot infer:

- the error object (gateway/errors.py renders every failure as OpenAI's `{"error": {...}}`), documented for
  each status a route can answer with, in place of Litestar's own validation-error shape, which is never sent;
- `additionalProperties: false` for models that refuse unknown fields (pydantic `extra="forbid"`), so the
  document does not promise to accept fields the gateway answers with a 400;
- the admin JWT as a bearer security scheme;
- request bodies that may be left out (rotate's), which Litestar always marks as required.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import annotated_types

from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar._openapi.schema_generation import SchemaCreator
from litestar.openapi.spec import Components, Operation, RequestBody, Schema, SecurityScheme
from litestar.plugins.pydantic import PydanticSchemaPlugin
from litestar.typing import FieldDefinition
from pydantic import BaseModel, ConfigDict, Field

ADMIN_SECURITY = "adminToken"


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: str = Field(description="what went wrong; never contains a key, token or header value")
    type: str = Field(description="OpenAI's error type, e.g. invalid_request_error")
    param: str | None = Field(description="the request field at fault, when there is one")
    code: str | None = Field(description="a stable machine-readable reason, e.g. key_not_found")


class ErrorBody(BaseModel):
    """The OpenAI error object: every failure the gateway answers has this body."""

    model_config = ConfigDict(extra="forbid", title="Error")
    error: ErrorDetail


WHY = {
    400: "The request is malformed: an invalid path parameter or body (the message names the field)",
    401: "Missing, malformed, expired or forged admin token",
    403: "The admin token may not do this (role viewer is read-only; operator may change variant weights only;"
         " team_admin may manage only its own team's keys)",
    404: "No API key has this id (or no team has the name given; no priority class of the policy has the name a"
         " team's max_priority_class gives; no model or variant of that name on the variant routes)",
    409: "The change conflicts with what is stored: a key that would allow more than its team, a team change that"
         " would leave a key above the team, a team that still has keys, or a variant change that would leave the"
         " model no live traffic",
    413: "The request body is larger than server.max_body_bytes",
    503: "The admin API is not configured, or the key store cannot be reached",
}


def errors(*statuses: int) -> dict[int, ResponseSpec]:
    """The error answers a route can give, each documented with the OpenAI error object."""
    return {
        status: ResponseSpec(data_container=ErrorBody, description=WHY[status], generate_examples=False)
        for status in statuses
    }


class StrictModels(PydanticSchemaPlugin):
    """Litestar's pydantic schemas, plus `additionalProperties: false` where the model forbids extra fields, and
    the `ge`/`le` bounds of a field that litestar leaves out when the bound is 0 (it tests them for truth)."""

    def to_openapi_schema(self, field_definition: FieldDefinition, schema_creator: SchemaCreator) -> Schema:
        schema = super().to_openapi_schema(field_definition, schema_creator)
        model = field_definition.annotation
        config = getattr(model, "model_config", {})
        if config.get("extra") == "forbid":
            schema.additional_properties = False
        for name, field in getattr(model, "model_fields", {}).items():
            prop = (schema.properties or {}).get(field.alias or name)
            if not isinstance(prop, Schema):  # absent, or a Reference (no bounds of its own)
                continue
            for bound in field.metadata:
                if isinstance(bound, annotated_types.Ge) and isinstance(bound.ge, float | int) and prop.minimum is None:
                    prop.minimum = bound.ge
                if isinstance(bound, annotated_types.Le) and isinstance(bound.le, float | int) and prop.maximum is None:
                    prop.maximum = bound.le
        return schema


@dataclass
class OptionalBody(Operation):
    """An operation whose request body may be left out (the handler then uses its defaults)."""

    def __post_init__(self) -> None:
        if isinstance(self.request_body, RequestBody):
            self.request_body.required = False


def openapi_config() -> OpenAPIConfig:
    try:
        release = version("llm-gateway")
    except PackageNotFoundError:  # running from a source tree that was never installed
        release = "0"
    return OpenAPIConfig(
        title="llm-gateway",
        version=release,
        description="Health, readiness and metrics, and the admin API for API keys. The OpenAI-compatible /v1"
        " routes follow OpenAI's own API reference and are not described here.",
        components=Components(security_schemes={
            ADMIN_SECURITY: SecurityScheme(
                type="http", scheme="bearer", bearer_format="JWT",
                description="an admin JWT (`llm-gateway admin-token`); role viewer may only read",
            ),
        }),
    )

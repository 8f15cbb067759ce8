"""What a free text (a refused reload's reason) keeps in an audit event: the places and messages, no secret."""

import pytest

from policies.audit import scrub_text
from policies.audit.log import MAX_TEXT_CHANGE


@pytest.mark.parametrize("text, kept, gone", [
    ("  models[0].backends[0].url: must be an http URL (got 'ftp://u:pw@h')", "backends[0].url: must be", "pw@"),
    ("providers[0].api_key: unknown field (not part of the policy schema)", "api_key: unknown field", "redacted"),
    ("  in line 5:\n      api_key: sk-short1", "api_key: [redacted]", "sk-short1"),
    ('    - password: "hunter2"', "password: [redacted]", "hunter2"),
    ("url http://user:s3cret@10.0.0.1/x", "http://user:[redacted]@10.0.0.1", "s3cret"),
    ("authorization header Bearer eyJhbGciOi.x.y", "Bearer [redacted]", "eyJ"),
    ("... -live-0123456789abcdefghijklmnop: x", "[redacted]: x", "0123456789"),
    ("/srv/llm-gateway/policies/production-cluster-policy.yaml", "production-cluster-policy.yaml", "redacted"),
])
def test_a_texts_secrets_are_redacted_and_its_places_kept(text: str, kept: str, gone: str) -> None:
    clean = scrub_text(text)
    assert kept in clean and gone not in clean, clean


def test_a_long_text_is_cut_and_says_so() -> None:
    clean = scrub_text("x " * 5000)
    assert len(clean) <= MAX_TEXT_CHANGE + 20 and clean.endswith("[truncated]")

"""POST /v1/audio/transcriptions and /v1/audio/translations: speech to text, as vLLM serves it for a speech
model (Whisper and the like).

The body is multipart/form-data streamed through to the replica as it arrives (gateway/http/form_upload.py): only
the `model` field is read, and renamed to the replica's served name; the file and every other field pass
byte for byte. Its size limit is the policy's `server.max_upload_bytes`. The answer is relayed as the replica
gives it: JSON, text, or, when the form asked `stream=true`, `data:` chunks ending in `[DONE]` (the token
usage chunk, which vLLM sends when the form asks `stream_include_usage=true`, is accounted). A whole answer's
usage is audio seconds, not tokens, so those calls count as requests only.
"""

from gateway.endpoints.base import MULTIPART, Route
from gateway.relay import SSERelay
from policies.config import Policy
from policies.pipeline import Call


def upload_limit(policy: Policy) -> int:
    return policy.server.max_upload_bytes


def relay(_call: Call, rename: tuple[bytes, bytes] | None) -> SSERelay:
    return SSERelay(strip_usage=False, rename=rename)


TRANSCRIPTIONS = Route("audio/transcriptions", "/v1/audio/transcriptions", body=MULTIPART, relay=relay,
                       max_body=upload_limit, plain_text=True, stream_by_answer=True)
TRANSLATIONS = Route("audio/translations", "/v1/audio/translations", body=MULTIPART, relay=relay,
                     max_body=upload_limit, plain_text=True, stream_by_answer=True)

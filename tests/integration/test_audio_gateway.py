"""The audio routes through the gateway to simulated vLLM replicas, driven by the openai SDK: transcriptions and
translations, plain and streamed, the upload streamed through with its model renamed and its bytes intact, the
size limit (413 in OpenAI's shape), and malformed multipart bodies answered 4xx, never 5xx."""

from __future__ import annotations

import hashlib

import httpx
import openai
import pytest

from tools.simulator import SimConfig, create_app
from tests.support.gateway import AUTH, TEST_KEY, one_model, running_gateway
from tests.support.servers import serve_app

FAST = SimConfig(model="served-m", step_base_ms=2, step_ms_per_seq=0)
LIMIT = 64 * 1024
AUDIO = bytes(range(256)) * 40  # 10 KiB of "audio"


@pytest.fixture
async def audio():
    async with serve_app(create_app(FAST)) as sim, \
            running_gateway(one_model(sim, server={"max_upload_bytes": LIMIT})) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=20) as sdk, \
            httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=20) as http:
        yield gw, sdk, http


async def test_transcriptions_and_translations_plain_and_streamed_through_the_sdk(audio):
    gw, sdk, _ = audio
    plain = await sdk.audio.transcriptions.create(model="m", file=("a.wav", AUDIO, "audio/wav"))
    assert plain.text and plain.usage.type == "duration" and plain.usage.seconds == 1
    translated = await sdk.audio.translations.create(model="m-alias", file=("a.wav", AUDIO, "audio/wav"))
    assert translated.text

    stream = await sdk.audio.transcriptions.create(model="m", file=("a.wav", AUDIO, "audio/wav"), stream=True,
                                                   extra_body={"stream_include_usage": True})
    raw = [c.model_dump() async for c in stream]
    assert any(r.get("choices") for r in raw) and raw[-1]["usage"]["completion_tokens"] > 0
    assert all(r.get("model") == "m" for r in raw)  # the served name never reaches the client
    assert await gw.metric("llm_gateway_requests_total", endpoint="audio/transcriptions", status="200") == 2
    assert await gw.metric("llm_gateway_requests_total", endpoint="audio/translations", status="200") == 1
    assert await gw.metric("llm_gateway_completion_tokens_total", model="m") == raw[-1]["usage"][
        "completion_tokens"]


async def test_the_upload_reaches_the_replica_byte_for_byte_but_for_the_model(audio):
    """An echoing replica behind the gateway sees the client's exact form, the model renamed."""
    seen: dict[str, bytes] = {}

    async def echo(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/v1/audio/transcriptions":
            seen["body"] = body
            seen["type"] = dict(scope["headers"])[b"content-type"]
        answer = b'{"text": "ok", "usage": {"type": "duration", "seconds": 1}}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})

    form = {"prompt": "a prompt", "model": "m", "language": "en"}
    sent = httpx.Request("POST", "http://x/v1/audio/transcriptions", data=form, files={"file": ("a.wav", AUDIO)})
    original = sent.read()
    async with serve_app(echo) as url, running_gateway(one_model(url, served="org/served-model")) as gw, \
            httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=20) as http:
        answer = await http.post("/v1/audio/transcriptions", content=original,
                                 headers={"content-type": sent.headers["content-type"]})
        assert answer.status_code == 200, answer.text
    assert seen["type"] == sent.headers["content-type"].encode()
    assert seen["body"] == original.replace(b"\r\n\r\nm\r\n", b"\r\n\r\norg/served-model\r\n", 1)
    assert hashlib.sha256(AUDIO).hexdigest() in {hashlib.sha256(p).hexdigest() for p in seen["body"].split(b"\r\n")}


async def test_an_upload_over_the_limit_gets_413_in_openais_shape(audio):
    gw, sdk, http = audio
    with pytest.raises(openai.APIStatusError) as refused:
        await sdk.audio.transcriptions.create(model="m", file=("big.wav", b"\0" * (LIMIT + 1), "audio/wav"))
    assert refused.value.status_code == 413 and refused.value.body["code"] == "request_too_large"

    async def chunked():  # no Content-Length: the limit is found while streaming, mid-upload
        boundary = b"--b0undary\r\n"
        yield boundary + b'Content-Disposition: form-data; name="model"\r\n\r\nm\r\n'
        yield boundary + b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        for _ in range(LIMIT // 8192 + 2):
            yield b"\1" * 8192
        yield b"\r\n--b0undary--\r\n"

    answer = await http.post("/v1/audio/transcriptions", content=chunked(),
                             headers={"content-type": "multipart/form-data; boundary=b0undary"})
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
    assert await gw.metric("llm_gateway_requests_total", status="500") == 0


MALFORMED = [
    ("application/json", b'{"model": "m"}'),
    ("multipart/form-data", b"no boundary"),
    ("multipart/form-data; boundary=zz", b"not multipart at all"),
    ("multipart/form-data; boundary=zz", b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'),
    ("multipart/form-data; boundary=zz", b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--zz\r\n'
                                         b'Content-Disposition: form-data; name="file"; filename="a"\r\n\r\nabc'),
    ("multipart/form-data; boundary=zz", b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\n\xff\xfe'
                                         b'\r\n--zz--\r\n'),
    ("multipart/form-data; boundary=zz", b'--zz\r\nno colon here\r\n\r\nm\r\n--zz--\r\n'),
    ("multipart/form-data; boundary=zz", b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--zz--\r\n'),
    ("multipart/form-data; boundary=zz", b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nnope\r\n'
                                         b'--zz--\r\n'),
    ("multipart/form-data; boundary=zz", b'--zz\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
                                         b'abc\r\n--zz--\r\n'),
]


async def test_malformed_multipart_gets_only_4xx(audio):
    gw, _, http = audio
    for content_type, raw in MALFORMED:
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            answer = await http.post(path, content=raw, headers={"content-type": content_type})
            assert 400 <= answer.status_code < 500, (raw, answer.status_code, answer.text)
            assert isinstance(answer.json().get("error"), dict), answer.text
    for status in ("500", "502", "504"):
        assert await gw.metric("llm_gateway_requests_total", status=status) == 0

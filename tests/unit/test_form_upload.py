"""The multipart upload streamed through (gateway/http/form_upload.py) and its body source: the model renamed and
every other byte kept whatever the chunking, a boundary split across reads, malformed forms refused, the size
limit enforced while streaming."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.http.form_upload import FormUpload
from gateway.openai_routes import BodyStream
from policies.errors import BadRequest, PayloadTooLarge

AUDIO = bytes(range(256)) * 3 + b"\r\n--" + b"not-the-boundary\r\n"  # delimiter-like bytes inside the file


def form(fields: dict, model_last: bool = False) -> tuple[bytes, str]:
    request = httpx.Request("POST", "http://x/", data=fields, files={"file": ("a.wav", AUDIO, "audio/wav")})
    body, content_type = request.read(), request.headers["content-type"]
    if model_last:  # the file first, the model after it (curl -F file=@a -F model=m)
        boundary = content_type.split("boundary=")[1].encode()
        parts = body.split(b"--" + boundary)
        body = b"--" + boundary + (b"--" + boundary).join([parts[-2], *parts[1:-2], parts[-1]])
    return body, content_type


async def chunks_of(body: bytes, cuts: list[int]):
    start = 0
    for cut in [*cuts, len(body)]:
        if cut > start:
            yield body[start:cut]
            start = cut


async def through(body: bytes, content_type: str, cuts: list[int], served: str = "org/served") -> tuple[dict, bytes]:
    upload = FormUpload(chunks_of(body, cuts), content_type)
    fields = await upload.read_head()
    sent = b"".join([c async for c in upload.upload(served)])
    return fields, sent


async def test_the_model_is_renamed_and_every_other_byte_kept_at_every_single_cut():
    body, content_type = form({"model": "m", "prompt": "hi", "stream": "true"})
    expected = body.replace(b"\r\n\r\nm\r\n", b"\r\n\r\norg/served\r\n", 1)
    for cut in range(1, len(body)):
        fields, sent = await through(body, content_type, [cut])
        assert fields == {"model": "m"}, cut  # read only up to the model's end: the stream field comes after
        assert sent == expected, cut


async def test_byte_by_byte_reads_and_a_model_after_the_file():
    for model_last in (False, True):
        body, content_type = form({"model": "whisper-large", "language": "en"}, model_last=model_last)
        expected = body.replace(b"\r\n\r\nwhisper-large\r\n", b"\r\n\r\norg/served\r\n", 1)
        assert expected != body
        fields, sent = await through(body, content_type, list(range(1, len(body))))
        assert fields["model"] == "whisper-large" and sent == expected


async def test_the_boundary_split_across_reads_at_every_position():
    body, content_type = form({"model": "m"})
    boundary = content_type.split("boundary=")[1].encode()
    at = body.find(b"--" + boundary, 10)  # the delimiter that closes the model's part
    for split in range(at - 2, at + len(boundary) + 4):
        _, sent = await through(body, content_type, [split - 1, split])
        assert sent == body.replace(b"\r\n\r\nm\r\n", b"\r\n\r\norg/served\r\n", 1), split


async def test_the_head_held_is_only_what_precedes_the_models_end():
    body, content_type = form({"model": "m"})
    upload = FormUpload(chunks_of(body, list(range(16, len(body), 16))), content_type)
    await upload.read_head()
    held = sum(map(len, upload.held))
    assert held < body.find(AUDIO)  # the file is not read before the upload is sent


async def test_without_a_model_the_body_passes_untouched():
    body, content_type = form({"language": "en"})
    fields, sent = await through(body, content_type, [7, 100])
    assert "model" not in fields and sent == body


@pytest.mark.parametrize("content_type, body", [
    ("application/json", b"{}"),
    ("multipart/form-data", b""),
    ("multipart/form-data; boundary=zz", b"garbage"),
    ("multipart/form-data; boundary=zz", b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nm'),
    ("multipart/form-data; boundary=zz", b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\n'
                                         + b"m" * 2000 + b"\r\n--zz--\r\n"),
])
async def test_malformed_forms_are_bad_requests(content_type, body):
    with pytest.raises(BadRequest):
        upload = FormUpload(chunks_of(body, [3]), content_type)
        await upload.read_head()
        [c async for c in upload.upload("x")]


async def test_a_form_broken_after_the_model_fails_while_streaming():
    body, content_type = form({"model": "m"})
    upload = FormUpload(chunks_of(body[:-10], [200]), content_type)
    await upload.read_head()
    sent = []
    with pytest.raises(BadRequest):
        async for chunk in upload.upload("x"):
            sent.append(chunk)
    assert sent  # the head went first; the replica never gets the body's end


def receiver(chunks: list[bytes], disconnect: bool = False):
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1 or disconnect}
                for i, c in enumerate(chunks)]
    if disconnect:
        messages.append({"type": "http.disconnect"})

    async def receive():
        return messages.pop(0)
    return receive


async def test_the_body_source_enforces_its_limit_while_streaming():
    ended = []
    source = BodyStream(receiver([b"a" * 600, b"b" * 500]), {}, 1024, lambda: ended.append(1))
    assert await anext(source) == b"a" * 600
    with pytest.raises(PayloadTooLarge):
        await anext(source)
    with pytest.raises(PayloadTooLarge):  # a declared length over the limit: refused before any read
        BodyStream(receiver([]), {"content-length": "1025"}, 1024, lambda: None)
    source = BodyStream(receiver([b"x" * 1024, b""]), {"content-length": "1024"}, 1024, lambda: ended.append(2))
    assert [c async for c in source] == [b"x" * 1024] and ended == [2]


async def test_a_client_gone_mid_upload_cancels_the_call():
    source = BodyStream(receiver([b"abc"], disconnect=True), {}, 1024, lambda: None)
    assert await anext(source) == b"abc"
    with pytest.raises(asyncio.CancelledError):
        await anext(source)
    assert source.gone

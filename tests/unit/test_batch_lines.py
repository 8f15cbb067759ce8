"""A batch's input lines as the runner reads them (policies/batches/jsonl.py `Lines` over
policies/batches/files.py `FileDir.mapped`): the file's non-blank lines in order, each parsed when asked for, the
bytes mapped from the volume; nothing of the file is held on the heap but where each line begins and ends."""

from __future__ import annotations

import asyncio
import tracemalloc

import orjson
import pytest

from policies.batches.files import FileDir
from policies.batches.jsonl import Lines


def line(n: int, pad: int = 0) -> bytes:
    return orjson.dumps({"custom_id": f"r-{n}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": "x" * pad}]}})


def test_the_non_blank_lines_in_order_as_a_split_reads_them():
    data = b"\n".join([line(0), b"", b"  \t", line(1) + b"\r", line(2)])  # blank ones, a CRLF, no final newline
    lines = Lines(data)
    expected = [orjson.loads(raw) for raw in data.split(b"\n") if raw.strip()]
    assert len(lines) == 3 and list(lines) == expected
    assert lines[-1]["custom_id"] == "r-2" and [x["custom_id"] for x in lines[1:]] == ["r-1", "r-2"]
    with pytest.raises(IndexError):
        lines[3]
    assert len(Lines(b"\n\n \n")) == 0


def test_a_mapped_file_is_read_line_by_line_without_holding_it_or_its_lines(tmp_path):
    files = FileDir(str(tmp_path))
    data = b"\n".join(line(n, pad=2_000) for n in range(10_000)) + b"\n"  # 20 MB
    asyncio.run(files.write("file-big", data))
    tracemalloc.start()
    try:
        mapped = asyncio.run(files.mapped("file-big"))
        assert mapped is not None
        lines = Lines(mapped)
        first, last = lines[0], lines[9_999]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(lines) == 10_000 and first["custom_id"] == "r-0" and last["custom_id"] == "r-9999"
    assert peak < 1_000_000, peak  # the spans (160 kB) and a line at a time; split and parsed whole: 51 MB at the peak, 30 MB kept
    mapped.close()
    assert asyncio.run(files.mapped("file-gone")) is None


def test_an_empty_or_vanished_file_maps_to_none(tmp_path):
    files = FileDir(str(tmp_path))
    (tmp_path / "file-empty").write_bytes(b"")
    assert asyncio.run(files.mapped("file-empty")) is None and asyncio.run(files.mapped("file-none")) is None

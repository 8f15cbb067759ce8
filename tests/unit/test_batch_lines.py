"""A batch's input lines as an upload's are checked while they arrive (policies/batches/jsonl.py `LineCheck`: in
any pieces, what the whole file says; a line past its bound refused before it ends) and as the runner reads them
(`Lines` over policies/batches/files.py `FileDir.mapped`: the non-blank lines in order, each parsed when asked
for, the bytes mapped from the volume; nothing of the file held on the heap but where each line begins and ends)."""

from __future__ import annotations

import asyncio
import tracemalloc

import orjson
import pytest

from policies.batches.files import FileDir
from policies.batches.jsonl import LineCheck, Lines, read_lines
from policies.errors import BadRequest


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
    blanks = b"\r\n\t\x0b\x0c \n \r"  # every byte bytes.strip() drops, alone or together
    assert len(Lines(blanks)) == 0 == len([raw for raw in blanks.split(b"\n") if raw.strip()])
    assert [x["custom_id"] for x in Lines(b" \t" + line(4) + b" \r\n\x0c")] == ["r-4"]
    padded = blanks + b"\n" + line(5) + b"\n\x0b\x0c\n" + line(6) + b"\t\r\n"
    assert read_lines(padded, 1_000, 1 << 20, lambda model: None).lines == len(Lines(padded)) == 2  # upload = run


def test_a_mapped_file_is_read_line_by_line_without_holding_it_or_its_lines(tmp_path):
    files = FileDir(str(tmp_path))
    data = b"\n".join(line(n, pad=2_000) for n in range(10_000)) + b"\n"  # 20 MB
    (tmp_path / "file-big").write_bytes(data)
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


def check_in_pieces(data: bytes, size: int, max_line_bytes: int = 1 << 20):
    check = LineCheck(1_000, max_line_bytes, lambda model: None)
    for at in range(0, len(data), size):
        check.feed(data[at:at + size])
    return check.end()


@pytest.mark.parametrize("size", [1, 7, 64, 100_000])
def test_lines_checked_as_they_arrive_in_any_pieces_say_what_the_whole_file_says(size):
    data = b"\n".join([line(0), b"", line(1, pad=300) + b"\r", b"  ", line(2)])  # no final newline
    assert check_in_pieces(data, size) == read_lines(data, 1_000, 1 << 20, lambda model: None)
    assert check_in_pieces(data, size).lines == 3
    broken = data.replace(b'"r-2"', b'"r-0"')
    with pytest.raises(BadRequest) as whole:
        read_lines(broken, 1_000, 1 << 20, lambda model: None)
    with pytest.raises(BadRequest) as pieces:
        check_in_pieces(broken, size)
    assert pieces.value.message == whole.value.message and "line 5:" in pieces.value.message


def test_a_line_past_its_bound_is_refused_before_it_ends_holding_no_more_than_the_bound():
    check = LineCheck(1_000, 1_000, lambda model: None)
    check.feed(line(0) + b"\n")
    with pytest.raises(BadRequest) as refused:
        for _ in range(1_000):  # a line that never ends
            check.feed(b"x" * 300)
    assert "line 2: the line is longer than the 1000 bytes" in refused.value.message
    assert check.held <= 1_000 + 300

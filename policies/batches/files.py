"""Uploaded and output files' bytes, one file each in a directory (a volume shared by every gateway replica: the
chart mounts a PVC there). Written to a temporary name and renamed, so a reader sees a whole file or none."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import re
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

SAFE_ID = re.compile(r"^file-[A-Za-z0-9_-]{1,64}$")


class FileDir:
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def _of(self, file_id: str) -> Path:
        if not SAFE_ID.match(file_id):  # ids are the gateway's own; never a path a client could bend
            raise ValueError("not a file id")
        return self.path / file_id

    async def drop_stale_temporaries(self, before: float) -> int:
        """Delete temporary files (uploads and writes under way) last written before `before` (unix seconds): a
        process that died mid-write leaves one; how many."""
        def drop() -> int:
            dropped = 0
            for path in self.path.glob(".*.tmp") if self.path.is_dir() else ():
                with contextlib.suppress(FileNotFoundError):  # another process's sweep took it first
                    if path.stat().st_mtime < before:
                        path.unlink()
                        dropped += 1
            return dropped

        return await asyncio.to_thread(drop)

    @contextlib.asynccontextmanager
    async def incoming(self) -> AsyncIterator[Incoming]:
        """A temporary file on the volume for an upload's bytes as they arrive: `keep` makes it a file of its
        own; left any other way (an error, a refusal, the client gone) it is removed."""
        upload = Incoming(self)
        try:
            yield upload
        finally:
            if not upload.kept:
                await asyncio.to_thread(upload.discard)

    async def mapped(self, file_id: str) -> mmap.mmap | None:
        """The file mapped read-only (pages read as they are touched, kept by the kernel's cache, not the heap);
        None if it is gone. The map outlives a rename or delete of the file; close it when done."""
        def open_map() -> mmap.mmap | None:
            try:
                with open(self._of(file_id), "rb") as f:
                    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else None
            except FileNotFoundError:
                return None

        return await asyncio.to_thread(open_map)

    async def delete(self, file_id: str) -> None:
        try:
            await asyncio.to_thread(self._of(file_id).unlink)
        except FileNotFoundError:
            pass


class Incoming:
    """An upload's bytes on their way to the volume: written in pieces of FLUSH bytes (each off the event loop),
    so an upload holds at most that much of itself in memory whatever its size."""

    FLUSH = 1 << 20

    def __init__(self, files: FileDir) -> None:
        self.files = files
        self.path = files.path / f".upload-{secrets.token_hex(8)}.{os.getpid()}.tmp"
        self.size = 0
        self.kept = False
        self._file: BinaryIO | None = None
        self._pending: list[bytes] = []
        self._held = 0

    async def write(self, chunk: bytes) -> None:
        self._pending.append(chunk)
        self._held += len(chunk)
        self.size += len(chunk)
        if self._held >= self.FLUSH:
            await asyncio.to_thread(self._flush)

    def _flush(self) -> None:
        if self._file is None:
            self.files.path.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "wb")  # noqa: SIM115 (closed by keep or discard)
        pieces, self._pending, self._held = self._pending, [], 0
        self._file.writelines(pieces)

    async def keep(self, file_id: str) -> None:
        """The upload, whole, as the file `file_id`: flushed to the disk, then renamed (a reader sees all or none)."""
        await asyncio.to_thread(self._keep, self.files._of(file_id))
        self.kept = True

    def _keep(self, target: Path) -> None:
        self._flush()
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.path, target)

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
        self.path.unlink(missing_ok=True)

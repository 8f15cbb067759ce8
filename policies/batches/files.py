"""Uploaded and output files' bytes, one file each in a directory (a volume shared by every gateway replica: the
chart mounts a PVC there). Written to a temporary name and renamed, so a reader sees a whole file or none."""

from __future__ import annotations

import asyncio
import mmap
import os
import re
from pathlib import Path

SAFE_ID = re.compile(r"^file-[A-Za-z0-9_-]{1,64}$")


class FileDir:
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def _of(self, file_id: str) -> Path:
        if not SAFE_ID.match(file_id):  # ids are the gateway's own; never a path a client could bend
            raise ValueError("not a file id")
        return self.path / file_id

    async def write(self, file_id: str, data: bytes) -> None:
        await asyncio.to_thread(self._write, file_id, data)

    def _write(self, file_id: str, data: bytes) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        target = self._of(file_id)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)

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

    async def read(self, file_id: str) -> bytes | None:
        try:
            return await asyncio.to_thread(self._of(file_id).read_bytes)
        except FileNotFoundError:
            return None

    async def delete(self, file_id: str) -> None:
        try:
            await asyncio.to_thread(self._of(file_id).unlink)
        except FileNotFoundError:
            pass

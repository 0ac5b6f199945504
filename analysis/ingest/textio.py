"""Bounded reading of text streams: capped line length and capped decompressed size."""
from __future__ import annotations

import gzip
import json
import re
import zlib
from typing import BinaryIO, Iterator

from analysis.ingest.errors import CorruptFile, TooLarge
from analysis.ingest.limits import Limits, human_size


class CappedReader:
    """Wraps a (decompressing) binary stream and refuses to yield more than `cap` bytes."""

    def __init__(self, raw: BinaryIO, cap: int, name: str):
        self.raw, self.cap, self.name, self.count = raw, cap, name, 0

    def readline(self, size: int = -1) -> bytes:
        line = self.raw.readline(size)
        self._add(len(line))
        return line

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self._add(len(data))
        return data

    def _add(self, n: int) -> None:
        self.count += n
        if self.count > self.cap:
            raise TooLarge(self.name, None, f"decompressed content exceeds the cap of {human_size(self.cap)}",
                           "split the file, or raise DRIFT_MAX_DECOMPRESSED_MB if you host the app")


def open_text(fp: BinaryIO, name: str, limits: Limits, gz: bool) -> BinaryIO:
    if gz:
        return CappedReader(gzip.GzipFile(fileobj=fp, mode="rb"), limits.max_decompressed_bytes, name)
    return fp


def iter_lines(fp: BinaryIO, name: str, limits: Limits) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes); a line over the cap is refused instead of read whole."""
    n = 0
    while True:
        try:
            line = fp.readline(limits.max_line_bytes + 1)
        except (OSError, EOFError, zlib.error) as e:
            raise CorruptFile(name, f"after line {n}", f"stream cannot be read ({e})",
                              "the file is truncated or not valid gzip") from None
        if not line:
            return
        n += 1
        if len(line) > limits.max_line_bytes and not line.endswith(b"\n"):
            raise TooLarge(name, f"line {n}", f"a line is longer than the cap of {human_size(limits.max_line_bytes)}",
                           "write one sequence per line, or raise DRIFT_MAX_LINE_MB")
        yield n, line


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_line(line: bytes) -> object:
    """One line's JSON value; ValueError when it is not JSON or holds text that is not valid Unicode (a lone
    \\uD800-\\uDFFF escape decodes in Python but cannot be stored as UTF-8)."""
    obj = json.loads(line)
    if _SURROGATE_ESCAPE.search(line):  # rare: check the decoded text only when an escape could be half a pair
        json.dumps(obj, ensure_ascii=False).encode("utf-8")  # UnicodeEncodeError is a ValueError
    return obj

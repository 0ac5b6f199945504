"""The ingest exception hierarchy. Each message names the file, the place, the rule broken and the fix."""
from __future__ import annotations


class IngestError(Exception):
    """A file was refused; `str(err)` is the whole message shown to the user."""

    rule = "invalid input"

    def __init__(self, file: str, where: str | None, detail: str, fix: str | None = None):
        self.file, self.where, self.detail, self.fix = file, where, detail, fix
        parts = [f"{file}:"]
        if where:
            parts.append(f"{where}:")
        parts.append(detail)
        msg = " ".join(parts)
        if fix:
            msg += f" ({fix})"
        super().__init__(msg)


def parser_message(e: BaseException, limit: int = 200) -> str:
    """The first non-empty line of a third-party parser's message (torch may raise with an empty one)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else "the parser gave no reason")[:limit]


class UnknownFormat(IngestError):
    rule = "unknown format"


class NotALogFile(UnknownFormat):
    """Empty, or nothing like any accepted format: inside a folder such files are passed over, not refused."""
    rule = "not a log file"


class CorruptFile(IngestError):
    rule = "corrupt or truncated file"


class UnsafeFile(IngestError):
    rule = "refused for safety (pickle)"


class TooLarge(IngestError):
    rule = "size cap exceeded"


class MissingColumn(IngestError):
    rule = "missing required column"


class WrongType(IngestError):
    rule = "wrong type"


class BadValue(IngestError):
    rule = "value out of range"


class LengthMismatch(IngestError):
    rule = "mismatched lengths"


class DuplicateKey(IngestError):
    rule = "duplicate key"


class OrphanRouting(IngestError):
    rule = "routing for a token that does not exist"


class OrphanTopk(IngestError):
    rule = "top-k log-probs for a token that does not exist"


class BadExperts(IngestError):
    rule = "invalid expert ids"

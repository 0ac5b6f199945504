"""Every DRIFT_* environment variable, declared once (name, type, default, meaning), read and checked here.

A value its type refuses is a SettingError that names the variable, the value and what is expected. The command
line and the app call check() before anything else, so a typo stops them at start instead of midway. An unset or
blank variable means its default. Standard library only: every layer may read a setting.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

MiB = 1 << 20
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A DRIFT_* variable holds a value its type refuses."""


# -- the types: one parser each, from the stripped, non-blank text to the value (ValueError when refused) --------
@dataclass(frozen=True)
class Kind:
    label: str                    # the type, as the settings table names it
    expected: str                 # the end of the error message: "expected <this>"
    parse: Callable[[str], Any]


def _bool(text: str) -> bool:
    word = text.lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ValueError(word)


def _whole(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not re.fullmatch(r"[0-9]+", text) or int(text) < minimum:
            raise ValueError(text)
        return int(text)
    return parse


def _positive_number(text: str) -> float:
    value = float(text)  # ValueError for what is no number
    if not (math.isfinite(value) and value > 0):
        raise ValueError(text)
    return value


# DuckDB's own units for memory_limit (DBConfig::ParseMemoryLimit), any case: 1000^i and 1024^i
_MEMORY = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[0-9]+)?\s*"
                     r"(b|bytes?|k|kb|kilobytes?|kib|m|mb|megabytes?|mib|g|gb|gigabytes?|gib|t|tb|terabytes?|tib)",
                     re.IGNORECASE)


def _memory(text: str) -> str:
    """The text as given (DuckDB parses it), once it is a positive size with a unit."""
    match = _MEMORY.fullmatch(text)
    if not match or not float(match.group(1)) > 0:
        raise ValueError(text)
    return text


def _paths(text: str) -> tuple[Path, ...]:
    return tuple(Path(p.strip()).expanduser() for p in text.split(os.pathsep) if p.strip())


def _items(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


BOOL = Kind("true/false", f"one of {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}", _bool)
POSITIVE_INT = Kind("whole number > 0", "a positive whole number", _whole(1))
NATURAL = Kind("whole number ≥ 0", "a whole number, 0 or more", _whole(0))
MIB = Kind("MiB (number > 0)", "a positive number of MiB", lambda text: int(_positive_number(text) * MiB))
SECONDS = Kind("seconds (number > 0)", "a positive number of seconds", _positive_number)
MEMORY = Kind("memory size", "a memory size such as 512MB or 2GiB (a number, then B, KB, MB, GB, TB, KiB, MiB, "
              "GiB or TiB)", _memory)
PATH = Kind("path", "a path", lambda text: Path(text).expanduser())
PATHS = Kind("paths separated by `:` (`;` on Windows)", f"paths separated by {os.pathsep!r}", _paths)
ITEMS = Kind("comma-separated list", "a comma-separated list", _items)


# -- the settings ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    name: str
    kind: Kind
    default: Any
    meaning: str
    shown_default: str = ""   # the default as the table shows it, when its value alone would not say it
    test_only: bool = False   # read by the tests only: listed so the table is complete, never read here

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value in `environ` (default os.environ), or the default when unset or blank."""
        text = (os.environ if environ is None else environ).get(self.name, "")
        if not text.strip():
            return self.default
        try:
            return self.kind.parse(text.strip())
        except ValueError:
            raise SettingError(f"{self.name}={text!r}: expected {self.kind.expected}") from None


REPO_ROOT = Path(__file__).resolve().parent.parent

DB = Setting("DRIFT_DB", PATH, REPO_ROOT / "data" / "drift.duckdb",
             "the DuckDB file the app and the command line open (`--db` overrides it on the command line)",
             "`data/drift.duckdb`")
MEMORY_LIMIT = Setting("DRIFT_MEMORY_LIMIT", MEMORY, None,
                       "DuckDB `memory_limit` of every database the app and the command line open; set it on any "
                       "shared host", "DuckDB's (80% of RAM); `512MB` for `python -m analysis ingest`")
THREADS = Setting("DRIFT_THREADS", POSITIVE_INT, None, "DuckDB `threads`", "DuckDB's (all cores)")
DEBUG = Setting("DRIFT_DEBUG", BOOL, False, "`python -m analysis ingest` logs at debug level, with the traceback of "
                "an internal error (without it: one `error` line)")
MAX_UPLOAD = Setting("DRIFT_MAX_UPLOAD_MB", MIB, 1024 * MiB, "the most one upload on the Data page may hold (all "
                     "files picked for one Load, summed); more is refused before anything is read", "1024")
MAX_DECOMPRESSED = Setting("DRIFT_MAX_DECOMPRESSED_MB", MIB, 4096 * MiB,
                           "a `.gz` stream or a zip archive, decompressed, at most", "4096")
MAX_LINE = Setting("DRIFT_MAX_LINE_MB", MIB, 64 * MiB, "one JSON line (one sequence) at most", "64")
MAX_TENSOR_FILE = Setting("DRIFT_MAX_TENSOR_FILE_MB", MIB, 2048 * MiB,
                          "a `.pt` / `.safetensors` file (read whole) at most", "2048")
NO_DEMO = Setting("DRIFT_NO_DEMO", BOOL, False, "an empty database stays empty instead of getting the demo runs")
READ_ONLY = Setting("DRIFT_READ_ONLY", BOOL, False, "viewer mode: no upload, delete, config edit or lab run on any "
                    "page; an existing database is opened read-only (read-write for the live watcher only, with "
                    "`DRIFT_WATCH_DIRS`)")
NO_WARM = Setting("DRIFT_NO_WARM", BOOL, False, "the app does not start `python -m analysis warm` (compiles the "
                  "ingest kernels in a low-priority child) when it opens a writable database")
PREFETCH = Setting("DRIFT_PREFETCH", BOOL, True, "the app computes the default views of the other tabs and pages "
                   "in the background")
WARM_NICE = Setting("DRIFT_WARM_NICE", NATURAL, None, "niceness `python -m analysis warm` adds to itself (the app "
                    "sets 10 for its background warm, so it gives way to the pages)", "none (no change)")
WATCH_DIRS = Setting("DRIFT_WATCH_DIRS", PATHS, (), "the folders the app follows live, loading each new complete "
                     "file; nothing else can name a folder", "none")
WATCH_INTERVAL = Setting("DRIFT_WATCH_INTERVAL", SECONDS, 0.5, "seconds between polls of `DRIFT_WATCH_DIRS` and "
                         "between live page refreshes (kept within 0.2–60)")
ALLOWED_EMAILS = Setting("DRIFT_ALLOWED_EMAILS", ITEMS, (), "with sign-in: the addresses allowed in (any case)",
                         "everyone the provider signs in")
ALLOWED_DOMAIN = Setting("DRIFT_ALLOWED_DOMAIN", ITEMS, (), "with sign-in: the email domains allowed in (exact: "
                         "`example.org` does not admit `sub.example.org`)", "everyone the provider signs in")
SCREENSHOTS = Setting("DRIFT_SCREENSHOTS", PATH, None, "tests only: the folder (in the repository) the browser tests "
                      "save full-page screenshots in; `docs/screenshots` refreshes the tracked ones",
                      "the test's temporary folder", test_only=True)

ALL = (DB, MEMORY_LIMIT, THREADS, DEBUG, MAX_UPLOAD, MAX_DECOMPRESSED, MAX_LINE, MAX_TENSOR_FILE, NO_DEMO,
       READ_ONLY, NO_WARM, PREFETCH, WARM_NICE, WATCH_DIRS, WATCH_INTERVAL, ALLOWED_EMAILS, ALLOWED_DOMAIN,
       SCREENSHOTS)


def check(environ: Mapping[str, str] | None = None) -> None:
    """Read every setting the project reads; a SettingError naming every refused one, on one line."""
    problems = []
    for setting in (s for s in ALL if not s.test_only):
        try:
            setting.read(environ)
        except SettingError as e:
            problems.append(str(e))
    if problems:
        raise SettingError("; ".join(problems))


def _shown(setting: Setting) -> str:
    if setting.shown_default:
        return setting.shown_default
    if setting.kind is BOOL:
        return "on" if setting.default else "off"
    return f"{setting.default:g}" if isinstance(setting.default, float) else str(setting.default)


def markdown_table() -> str:
    """The settings as a markdown table (README, Settings).

    >>> print(markdown_table().splitlines()[0])
    | variable | type | default | meaning |
    """
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.kind.label} | {_shown(s)} | {s.meaning} |" for s in ALL]
    return "\n".join(rows)

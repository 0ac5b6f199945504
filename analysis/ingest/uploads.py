"""Uploaded files (file-like objects from a browser): spooled to private temp files, then loaded.

No user text reaches a server path: each upload is written under a fresh temporary directory with a
generated name; the user's file name is kept only as a display label. Zip archives are expanded with
the same rule (members get generated paths; '..' or absolute member names are refused).
"""
from __future__ import annotations

import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import BinaryIO, Callable, Sequence

from analysis.ingest.errors import TooLarge, UnsafeFile
from analysis.ingest.limits import Limits, human_size
from analysis.ingest.load import Outcome, expand, load_units
from analysis.store import Store

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def display_name(name: str) -> str:
    """The user's file name reduced to a harmless label (no directories, no control characters)."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    base = _SAFE.sub("_", base).strip("._") or "upload"
    return base[:120]


def _spool(fp: BinaryIO, dest: Path, cap: int | None) -> int:
    size = 0
    with open(dest, "wb") as out:
        while chunk := fp.read(1 << 20):
            size += len(chunk)
            if cap is not None and size > cap:
                raise TooLarge(dest.name, None, f"upload exceeds the cap of {human_size(cap)}", "split the upload")
            out.write(chunk)
    return size


def _extract_zip(path: Path, label: str, dest: Path, limits: Limits) -> None:
    total = 0
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            parts = Path(info.filename).parts
            if info.filename.startswith(("/", "\\")) or ".." in parts or any(":" in p for p in parts):
                raise UnsafeFile(label, f"member {info.filename!r}", "archive member points outside the archive",
                                 "zip the folder with relative paths")
            total += info.file_size
            if total > limits.max_decompressed_bytes:
                raise TooLarge(label, None, f"archive expands beyond {human_size(limits.max_decompressed_bytes)}",
                               "upload fewer files at once")
            target = dest.joinpath(*[display_name(p) for p in parts])
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                written = 0
                while chunk := src.read(1 << 20):
                    written += len(chunk)
                    if written > info.file_size:  # a member that lies about its size
                        raise TooLarge(label, f"member {info.filename!r}", "member is larger than declared",
                                       "re-create the archive")
                    out.write(chunk)


def ingest_uploads(store: Store, uploads: Sequence[tuple[str, BinaryIO]], run: str | None = None,
                   limits: Limits | None = None, max_bytes: int | None = None,
                   progress: Callable[[int, int, str], None] | None = None) -> list[Outcome]:
    """Load browser uploads [(file name, file object)]; one Outcome per file (or per archive member)."""
    limits = limits or Limits.from_env()
    outcomes: list[Outcome] = []
    tmp = Path(tempfile.mkdtemp(prefix="driftscope-upload-"))
    try:
        paths: list[tuple[Path, str]] = []
        for i, (name, fp) in enumerate(uploads):
            label = display_name(name)
            folder = tmp / f"u{i:04d}"
            folder.mkdir()
            path = folder / "data"
            try:
                _spool(fp, path, max_bytes)
                if zipfile.is_zipfile(path) and not _is_torch_zip(path):
                    root = folder / "x" / Path(label).stem
                    root.mkdir(parents=True)
                    _extract_zip(path, label, root, limits)
                    path.unlink()
                    paths.append((root, label))
                else:
                    paths.append((path, label))
            except (TooLarge, UnsafeFile) as e:
                outcomes.append(Outcome(label, "refused", message=str(e).replace(f"{e.file}:", f"{label}:", 1)))
            except zipfile.BadZipFile as e:
                outcomes.append(Outcome(label, "refused", message=f"{label}: zip archive cannot be read ({e})"))
        units = []
        for path, label in paths:
            u, refused = expand([path], limits)
            for unit in u:
                if path.is_file():
                    unit.name = label
                else:
                    unit.name = f"{label}/{unit.name.split('/', 1)[-1]}"
            for o in refused:
                if path.is_file():  # the message names the upload, not its spooled file
                    o.name, o.message = label, o.message.replace(f"{path.name}:", f"{label}:", 1)
            units.extend(u)
            outcomes.extend(refused)
        return outcomes + load_units(store, units, run, limits, progress=progress)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _is_torch_zip(path: Path) -> bool:
    with zipfile.ZipFile(path) as zf:
        return any(n.endswith("data.pkl") for n in zf.namelist())

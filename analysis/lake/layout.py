"""The lake layout: hive-partitioned Parquet of full logs, `run=<name>/step=<n>/<kind>-r<rank>.parquet`.

    LAKE/run=qwen3-bf16/run.json                        {"run": ..., "config": {...}} (optional)
    LAKE/run=qwen3-bf16/step=12/tokens-r00000.parquet   SCHEMA.md `tokens` rows of step 12 from rank 0
    LAKE/run=qwen3-bf16/step=12/routing-r00000.parquet  SCHEMA.md `routing` rows of the same tokens

A file is told to be tokens or routing by its columns, as ingest does; the name prefix is for people and
globs (`run=*/step=*/tokens-*.parquet`). Names starting with `.` or `_` (temporary files being written,
`_SUCCESS` markers) are not part of the lake. LAKE is a local path or any URI pyarrow opens (s3://, gs://,
hdfs://). See docs/SCHEMA.md, "Lake layout".
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

RUN_JSON = "run.json"
_STEP = re.compile(r"[0-9]{1,18}")


@dataclass(frozen=True)
class Partition:
    """One (run, step) of the lake and its Parquet files (full paths inside the lake's filesystem)."""
    run: str
    step: int
    files: tuple[str, ...]
    path: str  # the partition folder, for messages

    @property
    def name(self) -> str:
        return f"run={self.run}/step={self.step}"


@dataclass
class Listing:
    """Every partition found under a lake root, the runs' configs, and the folders that are not the layout."""
    uri: str
    partitions: list[Partition] = field(default_factory=list)
    configs: dict[str, dict] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def open_lake(lake: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, root path inside it) for a local path or a URI pyarrow knows."""
    if "://" not in lake:
        lake = os.path.abspath(lake)
    try:
        fs, root = pafs.FileSystem.from_uri(lake)
    except (pa.ArrowException, ValueError, OSError) as e:
        raise ValueError(f"cannot open the lake {lake!r}: {e}") from None
    return fs, root.rstrip("/")


def _hive(part: str, key: str) -> str | None:
    """The value of a `key=value` folder name (percent-decoded, as pyarrow and Spark write it), else None."""
    prefix = key + "="
    return unquote(part[len(prefix):]) if part.startswith(prefix) else None


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def list_partitions(lake: str, run: str | None = None) -> Listing:
    """Walk `run=*/step=*/` under `lake` (only `run=<run>` when given) and group the Parquet files."""
    import json

    fs, root = open_lake(lake)
    listing = Listing(lake)
    info = fs.get_file_info(root)
    if info.type != pafs.FileType.Directory:
        raise ValueError(f"the lake {lake!r} is not a folder")
    by_key: dict[tuple[str, int], list[str]] = {}
    for run_dir in fs.get_file_info(pafs.FileSelector(root)):
        if _hidden(run_dir.base_name):
            continue
        name = _hive(run_dir.base_name, "run")
        if run_dir.type != pafs.FileType.Directory or not name:
            listing.problems.append(f"{run_dir.path}: not a run=<name> folder (lake layout: "
                                    f"run=<name>/step=<n>/*.parquet); passed over")
            continue
        if run is not None and name != run:
            continue
        for entry in fs.get_file_info(pafs.FileSelector(run_dir.path)):
            if _hidden(entry.base_name):
                continue
            if entry.base_name == RUN_JSON and entry.type == pafs.FileType.File:
                try:
                    with fs.open_input_stream(entry.path) as f:
                        meta = json.loads(f.read(1 << 20))
                    if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
                        listing.configs[name] = meta["config"]
                except (ValueError, OSError):
                    listing.problems.append(f"{entry.path}: not a JSON object; the run's config is left empty")
                continue
            step = _hive(entry.base_name, "step")
            if entry.type != pafs.FileType.Directory or step is None or not _STEP.fullmatch(step):
                listing.problems.append(f"{entry.path}: not a step=<n> folder (n an integer >= 0); passed over")
                continue
            files = [f.path for f in fs.get_file_info(pafs.FileSelector(entry.path))
                     if f.type == pafs.FileType.File and not _hidden(f.base_name)
                     and f.base_name.endswith(".parquet")]
            if files:
                by_key.setdefault((name, int(step)), []).extend(files)
    listing.partitions = [Partition(r, s, tuple(sorted(f)), f"{root}/run={r}/step={s}")
                          for (r, s), f in sorted(by_key.items())]
    return listing


def partition_dir(root: str, run: str, step: int) -> str:
    return f"{root.rstrip('/')}/run={run}/step={int(step)}"


def write_file(lake: str, run: str, step: int, kind: str, rank: int, table: pa.Table) -> str:
    """Write one rank's `kind` rows of one step into the lake; returns the file's path.

    Written under a hidden temporary name and then renamed, so a reader listing the lake never sees half a
    file (on object stores the rename is a copy, and the object appears whole when it is complete)."""
    if kind not in ("tokens", "routing"):
        raise ValueError(f"kind must be 'tokens' or 'routing', got {kind!r}")
    fs, root = open_lake(lake)
    folder = partition_dir(root, run, step)
    fs.create_dir(folder, recursive=True)
    final = f"{folder}/{kind}-r{int(rank):05d}.parquet"
    write_parquet(fs, final, table)
    return final


def write_parquet(fs: pafs.FileSystem, path: str, table: pa.Table, metadata: dict[str, str] | None = None) -> None:
    """Write `table` at `path` via a hidden temporary name in the same folder and a rename."""
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    folder, name = path.rsplit("/", 1)
    tmp = f"{folder}/.{name}.tmp"
    with fs.open_output_stream(tmp) as out:
        pq.write_table(table, out, compression="zstd", store_schema=True, write_statistics=True)
    fs.move(tmp, path)


def write_run_json(lake: str, run: str, config: dict | None) -> None:
    """`run=<run>/run.json`, the run's config (written once per run, like DriftLogger's folder layout)."""
    import json

    fs, root = open_lake(lake)
    folder = f"{root}/run={run}"
    fs.create_dir(folder, recursive=True)
    text = json.dumps({"run": run, "config": config}, indent=2, sort_keys=True) + "\n"
    tmp = f"{folder}/.{RUN_JSON}.tmp"
    with fs.open_output_stream(tmp) as out:
        out.write(text.encode("utf-8"))
    fs.move(tmp, f"{folder}/{RUN_JSON}")

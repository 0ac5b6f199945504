"""The lake layout: hive-partitioned Parquet of full logs, `run=<name>/step=<n>/<kind>-r<rank>.parquet`.

    LAKE/run=qwen3-bf16/run.json                        {"run": ..., "config": {...}} (optional)
    LAKE/run=qwen3-bf16/step=12/tokens-r00000.parquet   SCHEMA.md `tokens` rows of step 12 from rank 0
    LAKE/run=qwen3-bf16/step=12/routing-r00000.parquet  SCHEMA.md `routing` rows of the same tokens
    LAKE/run=qwen3-bf16/step=12/sequences-r00000.parquet  SCHEMA.md `sequences` rows (reward, texts, tag)

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
    """Group the Parquet files of `run=*/step=*/` under `lake` (only `run=<run>` when given) by partition.

    One recursive listing (on an object store: one paginated LIST, not one request per folder)."""
    import json

    fs, root = open_lake(lake)
    listing = Listing(lake)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        raise ValueError(f"the lake {lake!r} is not a folder")
    by_key: dict[tuple[str, int], list[str]] = {}
    foreign: set[str] = set()
    for info in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
        parts = info.path[len(root) + 1:].split("/")
        if info.type != pafs.FileType.File or any(_hidden(p) for p in parts):
            continue
        name = _hive(parts[0], "run") if len(parts) > 1 else None
        if name is not None and run is not None and name != run:
            continue
        if name and len(parts) == 2 and parts[1] == RUN_JSON:
            try:
                with fs.open_input_stream(info.path) as f:
                    meta = json.loads(f.read(1 << 20))
                listing.configs[name] = meta["config"] if isinstance(meta, dict) and \
                    isinstance(meta.get("config"), dict) else {}
            except (ValueError, OSError):
                listing.problems.append(f"{info.path}: not a JSON object; the run's config is left empty")
            continue
        step = _hive(parts[1], "step") if name and len(parts) == 3 else None
        if step is None or not _STEP.fullmatch(step):
            foreign.add("/".join(parts[:-1]) or parts[0])
            continue
        if parts[2].endswith(".parquet"):
            by_key.setdefault((name, int(step)), []).append(info.path)
    listing.problems += [f"{root}/{f}: not in the lake layout (run=<name>/step=<n>/*.parquet, n an integer >= 0); "
                         "passed over" for f in sorted(foreign)]
    listing.partitions = [Partition(r, s, tuple(sorted(f)), partition_dir(root, r, s))
                          for (r, s), f in sorted(by_key.items())]
    return listing


def partition_dir(root: str, run: str, step: int) -> str:
    return f"{root.rstrip('/')}/run={run}/step={int(step)}"


def write_file(lake: str, run: str, step: int, kind: str, rank: int, table: pa.Table) -> str:
    """Write one rank's `kind` rows of one step into the lake; returns the file's path.

    Written under a hidden temporary name and then renamed, so a reader listing the lake never sees half a
    file (on object stores the rename is a copy, and the object appears whole when it is complete)."""
    if kind not in ("tokens", "routing", "sequences"):
        raise ValueError(f"kind must be 'tokens', 'routing' or 'sequences', got {kind!r}")
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

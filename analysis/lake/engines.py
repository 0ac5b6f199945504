"""Where the partition tasks run: in this process (`duckdb`), or one Ray task per partition (`ray`).

Both yield one outcome per partition as it completes; the driver (analysis.lake.summarize) merges them.
Ray is imported only on its path: the rest of the project runs without it (requirements-ray.txt).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from analysis.lake.layout import Partition
from analysis.lake.task import PartitionResult, summarize_partition

# How often Ray re-runs a task whose worker died (a crash, an OOM kill, a lost node) before giving up on it.
MAX_RETRIES = 3
REPO_ROOT = str(Path(__file__).resolve().parent.parent.parent)

TaskFn = Callable[..., PartitionResult]


@dataclass
class Failed:
    """A partition whose task failed for good (after Ray's retries); `error` is the last error, in one line."""
    partition: Partition
    error: str


def run_local(lake: str, partitions: Sequence[Partition], token_sample: float = 0.0,
              task: TaskFn = summarize_partition) -> Iterator[PartitionResult | Failed]:
    """One partition after another in this process (DuckDB uses the cores inside each)."""
    for p in partitions:
        try:
            yield task(lake, p, token_sample, None)
        except Exception as e:  # a bug must not lose the other partitions' work
            yield Failed(p, f"task failed: {type(e).__name__}: {str(e)[:300]}")


def ray_init(address: str | None, num_cpus: int = 2):
    """Connect to the cluster at `address`, or start a local Ray with `num_cpus` when there is none."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("--engine ray needs Ray: python -m pip install -r requirements-ray.txt") from None
    if ray.is_initialized():
        return ray
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        # workers import `analysis` from this checkout (on a cluster, `ray job submit --working-dir .` does this)
        path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
    return ray


def run_ray(lake: str, partitions: Sequence[Partition], token_sample: float = 0.0, address: str | None = None,
            max_retries: int = MAX_RETRIES, task: TaskFn = summarize_partition,
            num_cpus: int = 2) -> Iterator[PartitionResult | Failed]:
    """One Ray task per partition, yielded in completion order. A task whose worker dies is re-run by Ray up
    to `max_retries` times; one that still fails is yielded as Failed with its partition."""
    ray = ray_init(address, num_cpus)
    # num_cpus=1 per task: DuckDB inside runs with one thread, so a node runs as many partitions as it has cores
    remote = ray.remote(num_cpus=1, max_retries=max_retries, retry_exceptions=False)(task)
    pending = {remote.remote(lake, p, token_sample, 1): p for p in partitions}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            p = pending.pop(ref)
            try:
                yield ray.get(ref)
            except ray.exceptions.RayTaskError as e:  # the task raised: a bug, not retried
                yield Failed(p, f"task raised {_last_line(e)}")
            except ray.exceptions.RayError as e:  # worker or node died on every attempt
                yield Failed(p, f"task failed after Ray retried it {max_retries} times: {type(e).__name__}: "
                                f"{_last_line(e)}")


def _last_line(e: Exception) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(e).__name__

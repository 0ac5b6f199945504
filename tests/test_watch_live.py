"""A real trainer process (tests/helpers/live_writer.py: DriftLogger, one step a second) and a real watcher
process (`python -m analysis watch`), killed with SIGKILL half-way and restarted: every step lands exactly once,
the file written in place slowly is never read half-written, the corrupt file is reported and skipped while the
next steps load, and the database holds exactly the values the writer wrote."""
from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import polars as pl

from analysis.store import Store

from helpers import live_writer as lw

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6


class Proc:
    """A subprocess whose stdout and stderr lines are collected by threads as they come."""

    def __init__(self, cmd: list[str]):
        self.p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.p.stdout, self.out), (self.p.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()

    def _pump(self, stream, sink):
        for line in stream:
            sink.append(line.rstrip("\n"))
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 30.0, prefix: bool = False) -> None:
        """Until a line equal to `text` (or starting with it) has come."""
        deadline = time.monotonic() + timeout
        while True:
            if any(line.startswith(text) if prefix else line == text for line in self.out + self.err):
                return
            left = deadline - time.monotonic()
            assert left > 0, f"no line {text!r} within {timeout} s; got {self.out} / {self.err}"
            try:
                self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                pass

    def stop(self, sig=signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
        try:
            return self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()


def watcher(logs: Path, db: Path) -> Proc:
    return Proc([sys.executable, "-m", "analysis", "watch", str(logs), "--db", str(db), "--interval", "0.25",
                 "--settle", "1.5"])


def expected_tokens() -> pl.DataFrame:
    """What the writer wrote, from its inputs (not from its files): every mask==1 token of every step."""
    parts = []
    for step in range(STEPS):
        a = lw.step_arrays(step)
        b, t = np.nonzero(a["mask"])
        parts.append(pl.DataFrame({"run": lw.RUN, "step": step, "sample": b.astype(np.int64),
                                   "pos": t.astype(np.int32), "sampler_logprob": a["sampler_logprobs"][b, t],
                                   "trainer_logprob": a["trainer_logprobs"][b, t]}))
    return pl.concat(parts + [pl.DataFrame(lw.slow_rows())], how="vertical_relaxed")


def test_a_killed_and_restarted_watcher_loads_every_step_of_a_live_run_exactly_once(tmp_path):
    logs, db = tmp_path / "logs", tmp_path / "drift.duckdb"
    writer = Proc([sys.executable, lw.__file__, str(logs), str(STEPS), "1.0", "--extras"])
    first = second = None
    try:
        writer.wait_for("0")
        first = watcher(logs, db)  # starts on a folder that already holds step 0
        first.wait_for("loaded ", prefix=True)
        writer.wait_for("3")
        first.p.kill()  # SIGKILL: no chance to clean up, a load may be cut mid-transaction
        first.p.wait(10)
        writer.wait_for("4")  # step 4 lands while no watcher runs
        second = watcher(logs, db)
        assert writer.p.wait(30) == 0, writer.err
        files = [f"{kind}-step{s:06d}.parquet" for s in range(STEPS) for kind in ("summary", "tokens", "routing")]
        second.wait_for(f"loaded {files[-1]} [parquet]: {lw.B * lw.T * lw.L} routing rows -> run {lw.RUN}")
        second.wait_for(f"loaded slow.jsonl [jsonl]: {len(lw.slow_rows())} tokens rows -> run {lw.SLOW_RUN}")
        assert second.stop() == 0  # SIGTERM: a clean stop
        assert second.err[-1] == "stopped"
    finally:
        for proc in (writer, first, second):
            if proc is not None and proc.p.poll() is None:
                proc.p.kill()

    # the restarted watcher has one line per file: skipped if the first one committed it, else loaded; a file
    # the first one reported loaded is never loaded again
    before_kill = {line.split()[1] for line in first.out if line.startswith("loaded ")}
    after = {status: [line.split()[1].rstrip(":") for line in second.out if line.startswith(status + " ")]
             for status in ("loaded", "skipped")}
    assert sorted(after["loaded"] + after["skipped"]) == sorted(files + ["slow.jsonl"])
    assert before_kill <= set(after["skipped"]) and before_kill, before_kill
    # the corrupt file: refused, once per watcher at most, with its name and reason; never the slow file
    for proc in (first, second):
        refused = [line for line in proc.err if line.startswith("refused")]
        assert len(refused) <= 1 and all(line.startswith("refused corrupt.parquet: ") for line in refused), refused
    assert any(line.startswith("refused corrupt.parquet: ") for line in first.err + second.err)

    with Store(db, read_only=True) as store:
        got = store.sql("SELECT run, step, sample, pos, sampler_logprob, trainer_logprob FROM tokens "
                        "ORDER BY run, step, sample, pos")
        routing = store.scalar("SELECT count(*) FROM routing WHERE run = ?", [lw.RUN])
        names = [r[0] for r in store.rows("SELECT name FROM files ORDER BY name")]
    want = expected_tokens().cast(dict(got.schema)).sort("run", "step", "sample", "pos")
    assert got.equals(want), (got, want)  # each token exactly once, values bit for bit
    assert routing == STEPS * lw.B * lw.T * lw.L
    assert names == sorted(files + ["slow.jsonl"])

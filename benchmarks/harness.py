"""What every benchmark here shares: the repository's paths, a child process timed on its own (wall, CPU, peak
RSS), sides timed in alternation, another commit's module beside this checkout's, and a result entry appended to
a benchmarks/RESULTS-*.md under a header that says on what machine and code it was measured.

A script imports this module and the input builders of benchmarks/inputs/, never another script; what the page
benchmarks share with the page tests is tests/helpers/browser.py (`browser()`)."""
from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "benchmarks" / "work"  # inputs and databases the benchmarks build (git-ignored)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # a script imports analysis/ from the checkout it is in, wherever it is run


def fresh_db(path: Path) -> Path:
    """`path` with no database there: the file and its write-ahead log removed."""
    for p in (path, Path(f"{path}.wal")):
        p.unlink(missing_ok=True)
    return path


def stamp_built(con, version: str, table: str = "build_info") -> None:
    """Mark a database a builder made as built by `version` (read back by `is_built`)."""
    con.execute(f"CREATE OR REPLACE TABLE {table} AS SELECT ? AS version", [version])


def is_built(path: Path, version: str, table: str = "build_info") -> bool:
    """Whether `path` holds a database a builder stamped with this `version` (so it need not be built again)."""
    import duckdb
    if not path.exists():
        return False
    try:
        con = duckdb.connect(str(path), read_only=True)
        try:
            return con.execute(f"SELECT version FROM {table}").fetchall()[0][0] == version
        finally:
            con.close()
    except duckdb.Error:
        return False


def browser():
    """tests/helpers/browser.py: the seeded page fixtures, a `streamlit run` server and headless Chromium that the
    page tests use, which the page benchmarks drive the same way."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from helpers import browser as module
    return module


# -- a child process, measured alone -------------------------------------------------------------------------
# Linux hands a process's peak RSS down to the children it forks (the copied address space keeps its high-water
# mark, which exec records): a child started by a process that once held 2 GB reports at least 2 GB. A small
# launcher, started fresh, forks the command instead, so its peak is the command's own.
_LAUNCHER = """
import json, os, sys, time
report, cmd = sys.argv[1], sys.argv[2:]
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(cmd[0], cmd)
    finally:
        os._exit(127)
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t0
with open(report, "w") as fp:
    json.dump({"seconds": wall, "cpu_seconds": ru.ru_utime + ru.ru_stime, "peak_rss_mb": ru.ru_maxrss / 1024,
               "returncode": os.waitstatus_to_exitcode(status)}, fp)
"""


def timed(cmd: list[str], cwd: Path | None = None, env: dict | None = None, check: bool = True) -> dict:
    """Run `cmd` as a child (in `cwd`, default the repository; `env` added to this environment) and return
    {seconds, cpu_seconds, peak_rss_mb, returncode, stdout, stderr}: wall time, user + system CPU of the child and
    of the processes it waited for, and its peak resident set (os.wait4). Output goes to temporary files, not
    pipes, which fill up when nobody reads them (one line per ingested file) and stall the child. With `check`,
    a failure ends the benchmark with the child's output."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        with open(Path(tmp) / "out", "w+b") as out, open(Path(tmp) / "err", "w+b") as err:
            subprocess.run([sys.executable, "-c", _LAUNCHER, str(report), *map(str, cmd)], stdout=out, stderr=err,
                           cwd=cwd or ROOT, env=os.environ | (env or {}), check=True)
            out.seek(0)
            err.seek(0)
            res = json.loads(report.read_text()) | {"stdout": out.read().decode(errors="replace"),
                                                     "stderr": err.read().decode(errors="replace")}
    if check and res["returncode"]:
        raise SystemExit(f"{' '.join(map(str, cmd[:4]))} ... failed ({res['returncode']}):\n{res['stdout'][-4000:]}\n"
                         f"{res['stderr'][-4000:]}")
    return res


# -- sides timed in alternation ------------------------------------------------------------------------------
@dataclass
class Runs:
    """One side's runs: the seconds of each (wall time around the call) and what each returned."""
    seconds: list[float] = field(default_factory=list)
    outs: list = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def out(self):
        """What the last run returned."""
        return self.outs[-1]


def alternate(sides: dict[str, Callable[[], object]], rounds: int, budget: float = float("inf")) -> dict[str, Runs]:
    """Time each side's call `rounds` times, alternating and reversing the order every round (a b, b a, a b, ...)
    so that a busy moment of the machine, or a cache one side warms for the next, hits every side alike. A side
    whose runs have taken `budget` seconds in all is not run again (every side runs at least once)."""
    runs = {name: Runs() for name in sides}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            if runs[name].seconds and sum(runs[name].seconds) >= budget:
                continue
            t0 = time.perf_counter()
            out = sides[name]()
            runs[name].seconds.append(time.perf_counter() - t0)
            runs[name].outs.append(out)
    return runs


def repeat(fn: Callable[[], object], rounds: int) -> Runs:
    """`fn` timed `rounds` times in a row."""
    return alternate({"": fn}, rounds)[""]


def best_of_pairs(a: Callable[[], object], b: Callable[[], object], rounds: int,
                  budget: float = float("inf")) -> tuple[Runs, Runs, float]:
    """`a` and `b` timed in alternation (see `alternate`): their runs and the ratio of the bests, a / b."""
    runs = alternate({"a": a, "b": b}, rounds, budget)
    return runs["a"], runs["b"], runs["a"].best / runs["b"].best


# -- another commit's code -----------------------------------------------------------------------------------
def module_at(commit: str, path: str, name: str):
    """The module `path` as it was at `commit`, imported from `git show` under `name`, to time beside this
    checkout's in the same process."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{path}"],
                         check=True, capture_output=True, text=True).stdout
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(src)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# -- result entries ------------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return float("nan")


def commit_of(checkout: Path = ROOT) -> str:
    """A checkout's short commit, with "with uncommitted changes" where its tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def command() -> str:
    """How this benchmark was started, as a reader would retype it from the repository."""
    script = Path(sys.argv[0]).resolve()
    shown = (script.relative_to(ROOT) if script.is_relative_to(ROOT) else script) if script.is_file() else sys.argv[0]
    return " ".join(["python", str(shown), *sys.argv[1:]])


def header(versions: dict[str, str] | None = None, note: str = "") -> str:
    """An entry's header: date and command, then the machine (CPU model, cores, RAM, load average now), Python's
    and duckdb's versions and any in `versions` (e.g. {"torch": torch.__version__}), the commit measured, and
    `note` (what else a reader must know to compare: threads, data)."""
    import duckdb

    soft = {"Python": platform.python_version(), "duckdb": duckdb.__version__} | (versions or {})
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC — `{command()}`", "",
             f"Machine: {_cpu_model()}, {os.cpu_count()} cores, {_ram_gib():.1f} GiB RAM, {platform.system()}; "
             + ", ".join(f"{k} {v}" for k, v in soft.items())
             + f"; load average {load:.1f} (other processes may share the cores)  ",
             f"Commit: {commit_of()}" + ("  " if note else "")]
    if note:
        lines.append(note)
    return "\n".join(lines) + "\n"


def append_result(results: Path, text: str, intro: str, new_entry: bool = True) -> None:
    """Append `text` to `results`, which is created with `intro` (its title and how to read it) when missing;
    after a blank line when it starts a `new_entry`, else right below the previous lines (an entry written as its
    results come)."""
    new = not results.exists()
    with open(results, "a", encoding="utf-8") as fp:
        if new:
            fp.write(intro.rstrip() + "\n")
        fp.write(("\n" if new_entry or new else "") + text.rstrip() + "\n")


def record(results: Path, body: str, intro: str, versions: dict[str, str] | None = None, note: str = "",
           write: bool = True) -> str:
    """Print one entry (header, then `body`) and append it to `results` unless `write` is false; returns it."""
    text = header(versions, note) + "\n" + body.rstrip() + "\n"
    print(text)
    if write:
        append_result(results, text, intro)
    return text

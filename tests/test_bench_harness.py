"""The benchmarks' shared harness (benchmarks/harness.py) on small cases: a timed child's own peak RSS, sides
timed in alternation on a fake clock, a result entry's header; and every benchmark script's --help, which must
print its usage and leave no file behind."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import harness  # noqa: E402

MB = 1 << 20


def test_a_timed_child_reports_its_own_peak_rss_wall_and_cpu():
    hog = b"x" * (256 * MB)  # this process's peak is now above 256 MB; Linux hands it to a plain child
    del hog
    big = harness.timed([sys.executable, "-c", "x = b'x' * (200 << 20); print('done')"])
    small = harness.timed([sys.executable, "-c", "pass"])
    assert big["peak_rss_mb"] >= 200, big
    assert small["peak_rss_mb"] < 100, small  # not this process's 256 MB
    assert big["stdout"] == "done\n" and big["returncode"] == 0
    assert big["seconds"] > 0 and big["cpu_seconds"] > 0


def test_a_failing_child_ends_the_benchmark_with_its_output_unless_told_not_to():
    cmd = [sys.executable, "-c", "import sys; print('why'); sys.exit(3)"]
    with pytest.raises(SystemExit, match="failed \\(3\\)(.|\n)*why"):
        harness.timed(cmd)
    assert harness.timed(cmd, check=False)["returncode"] == 3


class FakeClock:
    """time.perf_counter for harness.alternate: each side's call advances it by that side's next duration."""

    def __init__(self, durations: dict[str, list[float]]):
        self.t, self.durations, self.calls = 0.0, {k: iter(v) for k, v in durations.items()}, []

    def __call__(self) -> float:
        return self.t

    def side(self, name: str):
        def call():
            self.calls.append(name)
            self.t += next(self.durations[name])
            return name + str(len(self.calls))
        return call


def test_alternate_reverses_the_order_each_round_and_keeps_every_time_and_result(monkeypatch):
    clock = FakeClock({"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0, 6.0]})
    monkeypatch.setattr(time, "perf_counter", clock)
    a, b, ratio = harness.best_of_pairs(clock.side("a"), clock.side("b"), rounds=3)
    assert clock.calls == ["a", "b", "b", "a", "a", "b"]
    assert a.seconds == [3.0, 1.0, 2.0] and b.seconds == [5.0, 4.0, 6.0]
    assert (a.best, a.median, b.best, b.median) == (1.0, 2.0, 4.0, 5.0)
    assert ratio == 0.25
    assert a.outs == ["a1", "a4", "a5"] and b.out == "b6"


def test_a_side_over_its_budget_is_not_run_again(monkeypatch):
    clock = FakeClock({"fast": [1.0] * 7, "slow": [30.0, 30.0, 30.0]})
    monkeypatch.setattr(time, "perf_counter", clock)
    runs = harness.alternate({"fast": clock.side("fast"), "slow": clock.side("slow")}, rounds=5, budget=50.0)
    assert runs["fast"].seconds == [1.0] * 5
    assert runs["slow"].seconds == [30.0, 30.0]  # 60 s after two runs: over the budget of 50
    assert harness.repeat(clock.side("fast"), 2).seconds == [1.0, 1.0]


def test_an_entry_gets_the_machine_header_and_a_new_file_its_intro(tmp_path, capsys):
    results = tmp_path / "RESULTS-x.md"
    text = harness.record(results, "- a: 1.0 s", "# X benchmarks\n\nHow to read them.", {"numpy": "9.9"},
                          note="Data: tiny.")
    assert text in capsys.readouterr().out
    first = results.read_text()
    assert first.startswith("# X benchmarks\n\nHow to read them.\n\n## ")
    title, head, body = first.split("\n\n## ", 1)[1].split("\n\n")
    assert " UTC — `python " in title  # the date and the command that ran
    machine, commit, note = head.splitlines()
    assert machine.startswith("Machine: ") and f"{os.cpu_count()} cores" in machine and "GiB RAM" in machine
    for part in ("Python 3.", "duckdb ", "numpy 9.9", "load average"):
        assert part in machine, part
    assert commit.startswith("Commit: ") and note == "Data: tiny."
    assert body == "- a: 1.0 s\n"
    harness.record(results, "- a: 2.0 s", "# never written again", write=True)
    harness.append_result(results, "- b: 3.0 s", "# never written again", new_entry=False)
    second = results.read_text()
    assert second.startswith(first) and second.count("# X benchmarks") == 1 and "never written" not in second
    assert second.endswith("- a: 2.0 s\n- b: 3.0 s\n") and second.count("\n## ") == 2
    harness.record(results, "- c", "", write=False)
    assert results.read_text() == second


def _files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if "__pycache__" not in p.parts}


def test_every_benchmark_script_prints_its_usage_and_writes_nothing(tmp_path):
    """`--help` parses before anything runs: no database, input or result file appears, in the benchmarks'
    folders or in the folder it runs from (a script once created a database named `--help` there)."""
    scripts = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "harness.py")
    assert len(scripts) >= 12
    before = _files(BENCHMARKS) | _files(ROOT / "data")
    env = os.environ | {"PYTHONDONTWRITEBYTECODE": "1"}
    procs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=tmp_path, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE) for p in scripts}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (name, err[-2000:])
        assert out.startswith(f"usage: {name}"), (name, out[:200])
    assert list(tmp_path.iterdir()) == []
    assert _files(BENCHMARKS) | _files(ROOT / "data") == before

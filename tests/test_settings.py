"""analysis/settings.py: each type's accepted and refused values with the exact message, the defaults, a bad value
stopping the command line (exit 2, one line) and the app (st.error, no traceback), no DRIFT_ variable read
anywhere else, and every variable in the README's settings table."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from analysis import settings as S
from analysis.ingest.limits import Limits

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def refusal(setting: S.Setting, text: str) -> str:
    with pytest.raises(S.SettingError) as e:
        setting.read({setting.name: text})
    return str(e.value)


# -- one parser per type -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                         ("0", False), ("False", False), ("no", False), ("OFF", False)])
def test_bool_words_are_the_same_for_every_switch(text, value):
    for setting in (S.DEBUG, S.NO_DEMO, S.READ_ONLY, S.NO_WARM, S.PREFETCH):
        assert setting.read({setting.name: text}) is value, setting.name


@pytest.mark.parametrize("text", ["2", "maybe", "y", "enabled", "1.0"])
def test_bool_refuses_other_words(text):
    assert refusal(S.READ_ONLY, text) == f"DRIFT_READ_ONLY={text!r}: expected one of 1/true/yes/on or 0/false/no/off"


def test_positive_whole_number():
    assert S.THREADS.read({"DRIFT_THREADS": "1"}) == 1 and S.THREADS.read({"DRIFT_THREADS": " 16 "}) == 16
    assert refusal(S.THREADS, "two") == "DRIFT_THREADS='two': expected a positive whole number"
    for text in ("0", "-1", "1.5", "+2", "1e3", "²"):
        assert refusal(S.THREADS, text) == f"DRIFT_THREADS={text!r}: expected a positive whole number"


def test_whole_number_from_zero():
    assert S.WARM_NICE.read({"DRIFT_WARM_NICE": "0"}) == 0 and S.WARM_NICE.read({"DRIFT_WARM_NICE": "10"}) == 10
    for text in ("-1", "low", "2.5"):
        assert refusal(S.WARM_NICE, text) == f"DRIFT_WARM_NICE={text!r}: expected a whole number, 0 or more"


@pytest.mark.parametrize("text, mib", [("64", 64), ("0.5", 0.5), (" 2048 ", 2048), ("1e3", 1000)])
def test_mib_is_a_positive_number_read_as_bytes(text, mib):
    for setting in (S.MAX_UPLOAD, S.MAX_DECOMPRESSED, S.MAX_LINE, S.MAX_TENSOR_FILE):
        assert setting.read({setting.name: text}) == int(mib * MiB)


@pytest.mark.parametrize("text", ["0", "-3", "lots", "inf", "nan", "64MB"])
def test_mib_refuses_what_is_no_positive_number(text):
    assert refusal(S.MAX_LINE, text) == f"DRIFT_MAX_LINE_MB={text!r}: expected a positive number of MiB"


def test_seconds():
    assert S.WATCH_INTERVAL.read({"DRIFT_WATCH_INTERVAL": "2"}) == 2.0
    for text in ("0", "-1", "soon", "nan"):
        assert refusal(S.WATCH_INTERVAL, text) == (
            f"DRIFT_WATCH_INTERVAL={text!r}: expected a positive number of seconds")


# what DuckDB then reports: every accepted value is one DuckDB accepts, and means what it means there
@pytest.mark.parametrize("text, duckdb_says", [
    ("512MB", "488.2 MiB"), ("2GiB", "2.0 GiB"), ("1.5GB", "1.3 GiB"), ("512 mb", "488.2 MiB"), ("256mib", "256.0 MiB"),
    ("1g", "953.6 MiB"), ("1e3MB", "953.6 MiB"), ("2 gigabytes", "1.8 GiB"), ("1 TiB", "1.0 TiB")])
def test_memory_size_is_passed_to_duckdb_as_written(text, duckdb_says):
    value = S.MEMORY_LIMIT.read({"DRIFT_MEMORY_LIMIT": text})
    assert value == text.strip()
    with duckdb.connect(config={"memory_limit": value}) as con:
        assert con.sql("SELECT current_setting('memory_limit')").fetchall() == [(duckdb_says,)]


@pytest.mark.parametrize("text", ["512", "lots", "1PB", "-5MB", "0MB", "1GB x", "none", "-1", "80%", "1_000MB"])
def test_memory_size_refuses_what_is_no_positive_size_with_a_unit(text):
    assert refusal(S.MEMORY_LIMIT, text) == (
        f"DRIFT_MEMORY_LIMIT={text!r}: expected a memory size such as 512MB or 2GiB (a number, then B, KB, MB, GB, "
        "TB, KiB, MiB, GiB or TiB)")


def test_paths_and_lists():
    assert S.DB.read({"DRIFT_DB": "/srv/d.duckdb"}) == Path("/srv/d.duckdb")
    assert S.DB.read({"DRIFT_DB": "~/d.duckdb"}) == Path.home() / "d.duckdb"
    a, b = os.path.join("srv", "logs-a"), os.path.join("srv", "logs b")
    assert S.WATCH_DIRS.read({"DRIFT_WATCH_DIRS": f"{a}{os.pathsep}{b}{os.pathsep} "}) == (Path(a), Path(b))
    assert S.ALLOWED_EMAILS.read({"DRIFT_ALLOWED_EMAILS": " Ann@x.org, ,b@y.com "}) == ("Ann@x.org", "b@y.com")


# -- defaults --------------------------------------------------------------------------------------------------
DEFAULTS = {"DRIFT_DB": ROOT / "data" / "drift.duckdb", "DRIFT_MEMORY_LIMIT": None, "DRIFT_THREADS": None,
            "DRIFT_DEBUG": False, "DRIFT_MAX_UPLOAD_MB": 1024 * MiB, "DRIFT_MAX_DECOMPRESSED_MB": 4096 * MiB,
            "DRIFT_MAX_LINE_MB": 64 * MiB, "DRIFT_MAX_TENSOR_FILE_MB": 2048 * MiB, "DRIFT_NO_DEMO": False,
            "DRIFT_READ_ONLY": False, "DRIFT_NO_WARM": False, "DRIFT_PREFETCH": True, "DRIFT_WARM_NICE": None,
            "DRIFT_WATCH_DIRS": (), "DRIFT_WATCH_INTERVAL": 0.5, "DRIFT_ALLOWED_EMAILS": (),
            "DRIFT_ALLOWED_DOMAIN": (), "DRIFT_SCREENSHOTS": None}


@pytest.mark.parametrize("environ", [{}, {name: "" for name in DEFAULTS}, {name: "  " for name in DEFAULTS}])
def test_unset_or_blank_is_the_default(environ):
    assert {s.name: s.read(environ) for s in S.ALL} == DEFAULTS


def test_the_limits_defaults_are_the_settings_defaults(monkeypatch):
    for name in ("DRIFT_MAX_LINE_MB", "DRIFT_MAX_DECOMPRESSED_MB", "DRIFT_MAX_TENSOR_FILE_MB"):
        monkeypatch.delenv(name, raising=False)
    assert Limits.from_env() == Limits()
    monkeypatch.setenv("DRIFT_MAX_LINE_MB", "1.5")
    assert Limits.from_env().max_line_bytes == int(1.5 * MiB)


def test_every_variable_is_declared_once_with_a_meaning():
    names = [s.name for s in S.ALL]
    assert len(names) == len(set(names)) == 18
    assert all(re.fullmatch(r"DRIFT_[A-Z_]+", n) for n in names)
    assert all(s.meaning and s.kind.label for s in S.ALL)
    assert [s.name for s in S.ALL if s.test_only] == ["DRIFT_SCREENSHOTS"]


# -- the check at start ----------------------------------------------------------------------------------------
def test_check_names_every_refused_value_on_one_line():
    S.check({})
    S.check({"DRIFT_THREADS": "4", "DRIFT_READ_ONLY": "yes"})
    with pytest.raises(S.SettingError) as e:
        S.check({"DRIFT_THREADS": "two", "DRIFT_PREFETCH": "maybe", "DRIFT_DB": "x.duckdb"})
    assert str(e.value) == ("DRIFT_THREADS='two': expected a positive whole number; "
                            "DRIFT_PREFETCH='maybe': expected one of 1/true/yes/on or 0/false/no/off")


@pytest.mark.parametrize("command", [["runs"], ["ingest", "nothing.csv"], ["warm"], ["lab", "--help"]])
def test_the_command_line_stops_on_a_bad_value_with_one_line_and_exit_2(command, tmp_path):
    """Before it reads an argument or opens a database: no traceback, no file made."""
    out = subprocess.run([sys.executable, "-m", "analysis", *command, *(["--db", str(tmp_path / "x.duckdb")]
                                                                       if command[0] in ("runs", "ingest") else [])],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=os.environ | {"DRIFT_THREADS": "two"})
    assert out.returncode == 2, out.stderr
    assert out.stderr == "error: DRIFT_THREADS='two': expected a positive whole number\n"
    assert out.stdout == "" and not (tmp_path / "x.duckdb").exists()


@pytest.mark.slow  # AppTest runs app.py
def test_the_app_shows_a_bad_value_and_stops_before_drawing(monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest, app_test
    from helpers.apptest import TIMEOUT, NavigationOnly

    from ui.auth import md_escape

    monkeypatch.setattr(app_test, "PagesManager", NavigationOnly)
    monkeypatch.setenv("DRIFT_DB", str(tmp_path / "drift.duckdb"))
    monkeypatch.setenv("DRIFT_MAX_UPLOAD_MB", "lots")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT).run()
    assert not at.exception, at.exception
    assert [e.value for e in at.error] == [
        f"Driftscope cannot start: {md_escape(refusal(S.MAX_UPLOAD, 'lots'))}. Set it right in the server's "
        "environment, then restart the server."]
    assert not at.sidebar.children and not at.title and not at.multiselect  # nothing else drawn
    assert not (tmp_path / "drift.duckdb").exists()  # the database is never opened


# -- nothing reads a DRIFT_ variable but settings.py -------------------------------------------------------------
def _environ(node: ast.AST) -> bool:
    return ast.unparse(node).split(".")[-1] in ("environ", "env")


def drift_reads(path: Path) -> list[str]:
    """Where `path` names a DRIFT_ variable as a plain string (a key it reads or writes), or looks a key up in the
    environment through a name (which could hold one): the ways around settings.py."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"DRIFT_\w*", node.value):
            found.append((node.lineno, repr(node.value)))
        key = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if ast.unparse(f) in ("os.getenv", "getenv") or (
                    isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and _environ(f.value)):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and _environ(node.value):
            key = node.slice
        if key is not None and not isinstance(key, ast.Constant):
            found.append((node.lineno, ast.unparse(node)))
    return [f"{path.name}:{line} {what}" for line, what in sorted(found)]


def sources() -> list[Path]:
    return [p for d in ("analysis", "ui", "pages") for p in sorted((ROOT / d).rglob("*.py"))] + [ROOT / "app.py"]


def test_no_module_reads_a_drift_variable_but_settings():
    found = [hit for p in sources() if p != ROOT / "analysis" / "settings.py" for hit in drift_reads(p)]
    assert found == []


def test_the_scan_finds_the_ways_around_settings(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('import os\nname = "DRIFT_THREADS"\nos.environ.get("DRIFT_DB")\nos.getenv(name)\n'
                       'env = {}\nenv[name]\nos.environ.get("HOME")\nprint("raise DRIFT_MAX_LINE_MB")\n')
    assert drift_reads(planted) == ["planted.py:2 'DRIFT_THREADS'", "planted.py:3 'DRIFT_DB'",
                                    "planted.py:4 os.getenv(name)", "planted.py:6 env[name]"]
    assert drift_reads(ROOT / "analysis" / "settings.py")  # it does read them


def test_every_drift_variable_mentioned_is_declared():
    """A message or a doc that names a variable names one that exists (a typo shows up here)."""
    texts = [p for p in sources()] + sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "docs").glob("*.md"))
    mentioned = {m for p in texts for m in re.findall(r"\bDRIFT_[A-Z][A-Z_]*[A-Z]\b", p.read_text())}
    assert mentioned - {s.name for s in S.ALL} == set()


# -- the README's table ------------------------------------------------------------------------------------------
def readme_settings_names(text: str) -> set[str]:
    """The first column of the markdown table(s) under the first heading that contains "Settings"."""
    names, inside, fenced = set(), False, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif line.startswith("#") and not fenced:
            if inside:
                break
            inside = "settings" in line.lower()
        elif inside and line.startswith("|"):
            names.update(re.findall(r"DRIFT_[A-Z_]+", line.split("|")[1]))
    return names


def test_markdown_table_names_each_variable_once():
    table = S.markdown_table()
    assert readme_settings_names("## Settings\n" + table) == {s.name for s in S.ALL}
    assert len(table.splitlines()) == 2 + len(S.ALL)


def test_the_readme_settings_table_names_every_variable():
    readme = (ROOT / "README.md").read_text()
    assert sorted({s.name for s in S.ALL} - readme_settings_names(readme)) == []

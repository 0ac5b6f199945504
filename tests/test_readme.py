"""The README and docs/ against the tree: its length, its first two commands, the Layout and Settings sections,
every relative link, and the citations of docs/DIAGNOSIS.md in the code."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DIAGNOSIS = ROOT / "docs" / "DIAGNOSIS.md"
MAX_CHARS = 15_000
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def section(text: str, word: str) -> str:
    """The text under the first `## ` heading that contains `word`, up to the next `## ` heading."""
    match = re.search(rf"^## [^\n]*{word}[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no '## ...{word}...' heading in the README"
    return match.group(1)


# -- length and the first commands -----------------------------------------------------------------------------

def test_readme_is_a_page_not_a_log():
    n = len(README.read_text(encoding="utf-8"))
    assert n <= MAX_CHARS, f"README.md has {n:,} characters (at most {MAX_CHARS:,}): move detail into docs/ or benchmarks/"


def ci_test_command() -> str:
    """The command .ci/run runs: its last line that is neither blank nor a comment."""
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")][-1]


def test_the_two_commands_come_first_and_ci_runs_the_second():
    blocks = [b.strip() for b in FENCE.findall(README.read_text(encoding="utf-8"))]
    assert len(blocks) >= 2
    app, tests = blocks[:2]
    assert app == "python -m pip install -r requirements.txt && python -m streamlit run app.py"
    assert tests == ci_test_command()


# -- Layout names every module ---------------------------------------------------------------------------------

MODULE = re.compile(r"[a-z_][a-z0-9_]*(\.py)?")
FULL_PATH = re.compile(r"\b(?:analysis|ui)/[\w/]*\.py\b")


def named_in_layout(layout: str) -> set[str]:
    """The .py paths a Layout section names. In its code blocks, a line whose first word ends in `/` is a package
    (`ingest/`), inside the nearest line above it that is indented less and starts with a package; the other
    words before a `#` are modules of that package (`load` or `load.py`), or of the enclosing package when the line
    starts with a module. A package names its own __init__.py. A full path (`analysis/ingest/load.py`) anywhere
    in the section counts too."""
    named = set(FULL_PATH.findall(layout))
    for block in FENCE.findall(layout):
        stack: list[tuple[int, str]] = []  # (indent, package path) of the lines that opened packages
        for raw in block.splitlines():
            code = raw.split("#", 1)[0]
            words = code.split()
            if not words:
                continue
            indent = len(code) - len(code.lstrip())
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else ""
            if words[0].endswith("/"):
                package = f"{parent}/{words[0].rstrip('/')}".lstrip("/")
                stack.append((indent, package))
                named.add(f"{package}/__init__.py")
                words, parent = words[1:], package
            for word in words:
                if MODULE.fullmatch(word) and parent:
                    named.add(f"{parent}/{word.removesuffix('.py')}.py")
    return named


def test_the_layout_parser_reads_packages_continuations_and_paths():
    layout = ("```\nanalysis/   # lib\n  store.py   # db\n  ingest/ load stream  # write\n          keys\n"
              "    frameworks/ verl\n  findings/ gates\nui/\n  plot\n```\nAlso `analysis/lab/run.py`.\n")
    assert named_in_layout(layout) == {
        "analysis/__init__.py", "analysis/store.py", "analysis/ingest/__init__.py", "analysis/ingest/load.py",
        "analysis/ingest/stream.py", "analysis/ingest/keys.py", "analysis/ingest/frameworks/__init__.py",
        "analysis/ingest/frameworks/verl.py", "analysis/findings/__init__.py", "analysis/findings/gates.py",
        "ui/__init__.py", "ui/plot.py", "analysis/lab/run.py"}
    # a module named only in a comment, or under another package, is not named
    assert "analysis/ingest/db.py" not in named_in_layout(layout)
    assert "analysis/findings/verl.py" not in named_in_layout(layout)


def test_layout_names_every_module_of_analysis_and_ui():
    named = named_in_layout(section(README.read_text(encoding="utf-8"), "Layout"))
    files = sorted(p.relative_to(ROOT).as_posix() for pkg in ("analysis", "ui") for p in (ROOT / pkg).rglob("*.py"))
    missing = [f for f in files if f not in named]
    assert not missing, f"README's Layout section does not name: {missing}"


# -- Settings lists every DRIFT_* variable ----------------------------------------------------------------------

def drift_names_in_code() -> set[str]:
    """Every DRIFT_* name in the code that reads settings (a name ending in `_` is a prefix, not a variable)."""
    paths = [*(ROOT / "analysis").rglob("*.py"), *(ROOT / "ui").rglob("*.py"), ROOT / "app.py",
             ROOT / "tests" / "helpers" / "browser.py"]
    names = set()
    for path in paths:
        names.update(n for n in re.findall(r"\bDRIFT_[A-Z0-9_]+\b", path.read_text(encoding="utf-8"))
                     if not n.endswith("_"))
    return names


def test_settings_table_lists_every_drift_variable():
    settings = section(README.read_text(encoding="utf-8"), "Settings")
    rows = [ln for ln in settings.splitlines() if ln.startswith("|")]
    in_table = {n for ln in rows for n in re.findall(r"\bDRIFT_[A-Z0-9_]+\b", ln.split("|")[1])}
    code = drift_names_in_code()
    assert {"DRIFT_DB", "DRIFT_READ_ONLY", "DRIFT_SCREENSHOTS"} <= code  # the scan sees the code
    missing = sorted(code - in_table)
    assert not missing, f"README's Settings table has no row for {missing}"


# -- links ------------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")


def anchors(md: Path) -> set[str]:
    """The anchors GitHub makes of a markdown file's headings: lower case, punctuation dropped, spaces as `-`,
    `-1`, `-2` ... after a repeated one."""
    seen: dict[str, int] = {}
    out = set()
    text = FENCE.sub("", md.read_text(encoding="utf-8"))
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_anchors_follow_github():
    assert "table-tokens--one-row-per-response-token-the-trainer-trains-on" in anchors(ROOT / "docs" / "SCHEMA.md")


@pytest.mark.parametrize("md", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(md: Path):
    broken = []
    for target in LINK.findall(FENCE.sub("", md.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{md.name}: links to nothing: {broken}"


# -- docs/DIAGNOSIS.md and its citations ---------------------------------------------------------------------------

# what follows a citation and names a section: "Heading" or 'Heading' (after a comma or an opening parenthesis),
# or #anchor
SECTION = re.compile(r"""^(?:#([\w-]+)|,?\s*\(?\s*(["'])([A-Za-z0-9][^"'\n]*)\2)""")


def test_diagnosis_citations_name_the_file_and_its_sections():
    assert DIAGNOSIS.exists()
    headings = {h.strip().lower() for h in re.findall(r"^#{1,6} +(.+)$", DIAGNOSIS.read_text(encoding="utf-8"), re.M)}
    slugs = anchors(DIAGNOSIS)
    cited = 0
    for pkg in ("analysis", "ui", "pages"):
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            where = path.relative_to(ROOT).as_posix()
            assert not re.search(r"(?<!docs/)DIAGNOSIS\.md", text), f"{where}: cite it as docs/DIAGNOSIS.md"
            for match in re.finditer(r"docs/DIAGNOSIS\.md", text):
                cited += 1
                name = SECTION.match(text[match.end():])
                if name and name.group(1):
                    assert name.group(1) in slugs, f"{where}: no #{name.group(1)} in docs/DIAGNOSIS.md"
                elif name:
                    assert name.group(3).strip().lower() in headings, \
                        f"{where}: no heading '{name.group(3)}' in docs/DIAGNOSIS.md"
    assert cited, "the Findings code cites docs/DIAGNOSIS.md"

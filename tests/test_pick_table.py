"""ui/pick_table: what the browser is given for each cell (text formatted as the old grid's %.4g, sort keys, ids) on
hand-picked values, and that a value reaches the page as data (set as text by the script), never as markup."""
from __future__ import annotations

import json
import math

import polars as pl

from ui import pick_table

from helpers.apptest import pick_table as read_pick_table


def test_cells_keys_and_ids_of_mixed_columns():
    df = pl.DataFrame({"sample": [12, 3, 1_234_567], "x": [0.123456789, None, -2.5e-7],
                       "y": [float("nan"), 1.0, float("inf")], "tag": ["a", None, "<b>x</b>"],
                       "ok": [True, False, None]})
    got = pick_table.payload(df, "sample", picked=3)
    assert got["columns"] == ["sample", "x", "y", "tag", "ok"]
    assert got["kinds"] == ["num", "num", "num", "text", "text"]
    assert got["ids"] == [12, 3, 1_234_567] and got["picked"] == 3
    assert got["rows"] == [["12", "0.1235", "—", "a", "true"],
                           ["3", "—", "1", "—", "false"],
                           ["1,234,567", "-2.5e-07", "inf", "<b>x</b>", "—"]]
    # sort keys: the values themselves, missing and non-finite numbers as null (JSON has no NaN)
    assert got["sort"] == [[12, 0.123456789, None, "a", True], [3, None, 1.0, None, False],
                           [1_234_567, -2.5e-7, None, "<b>x</b>", None]]
    json.dumps(got, allow_nan=False)  # the payload is plain JSON


def test_cell_matches_printf_four_significant_digits():
    for v in (0.0, 1.0, -0.000123456, 98765.4321, 1e-12, 123456789.0, math.pi):
        assert pick_table.cell(v) == "%.4g" % v
    assert pick_table.cell(None) == "—" and pick_table.cell(float("nan")) == "—"


def test_an_empty_frame_gives_no_rows():
    got = pick_table.payload(pl.DataFrame({"sample": [], "x": []}, schema={"sample": pl.Int64, "x": pl.Float64}),
                             "sample")
    assert got["rows"] == [] and got["ids"] == [] and got["columns"] == ["sample", "x"]


def test_the_page_gets_data_not_markup(tmp_path):
    from streamlit.testing.v1 import AppTest

    app = tmp_path / "app.py"
    app.write_text("import polars as pl\nfrom ui.pick_table import pick_table\n"
                   "pick_table(pl.DataFrame({'sample': [4, 2], 'text': ['<img src=x onerror=alert(1)>', 'b']}), "
                   "'sample', key='t')\n")
    at = AppTest.from_file(str(app)).run()
    assert not at.exception
    (element,) = at.get("bidi_component")
    assert "<img" not in element.proto.js_content and "<img" not in element.proto.css_content
    assert "innerHTML" not in element.proto.js_content  # cells are set with textContent
    assert list(read_pick_table(at, "t")["text"]) == ["<img src=x onerror=alert(1)>", "b"]

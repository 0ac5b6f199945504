"""The app's pages in one list: app.py builds st.navigation from it, pages link to each other through it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PageInfo:
    path: str
    title: str
    icon: str
    url: str
    charts: bool = True  # its first view draws a chart (app.py starts loading plotly.js for it: ui/plot.preload)


FINDINGS = PageInfo("pages/findings.py", "Findings", ":material/lightbulb:", "findings", charts=False)
OVERVIEW = PageInfo("pages/overview.py", "Overview", ":material/dashboard:", "overview")
TOKENS = PageInfo("pages/token_drift.py", "Token drift", ":material/stacked_line_chart:", "token_drift")
ROUTING = PageInfo("pages/routing.py", "Routing", ":material/alt_route:", "routing")
EXPERT_LOAD = PageInfo("pages/expert_load.py", "Expert load", ":material/hub:", "expert_load")
SEQUENCES = PageInfo("pages/sequences.py", "Sequences", ":material/notes:", "sequences")
COMPARE = PageInfo("pages/compare.py", "Compare", ":material/compare_arrows:", "compare")
DATA = PageInfo("pages/data.py", "Data", ":material/database:", "data", charts=False)
LAB = PageInfo("pages/lab.py", "Lab", ":material/science:", "lab", charts=False)

ALL = [FINDINGS, OVERVIEW, TOKENS, ROUTING, EXPERT_LOAD, SEQUENCES, COMPARE, DATA, LAB]
BY_URL = {p.url: p for p in ALL}
SECTIONS = {"Analyse": [FINDINGS, OVERVIEW, TOKENS, ROUTING, EXPERT_LOAD, SEQUENCES, COMPARE], "Manage": [DATA, LAB]}

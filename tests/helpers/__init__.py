"""What more than one test module uses: seeded data builders, numpy references, the app under AppTest and in a
browser. Test modules import from here (and take pytest fixtures from conftest.py), never from each other.

tests/ is on sys.path under pytest (conftest.py's folder); a process a test starts adds it itself."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository

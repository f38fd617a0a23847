"""The protocol tests build a small real plan with the planner tests' synthetic profiles (one copy of that helper)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "planning"))

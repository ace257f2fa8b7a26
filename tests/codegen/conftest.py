"""Make ``import codegen_helpers`` work from the codegen tests whatever pytest's import mode."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

"""The README's tutorial runs as written: its Python blocks are executed in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_tutorial_runs() -> None:
    text = README.read_text(encoding="utf-8")
    # Each block padded to its line in the README, so that a traceback's line numbers are the
    # README's. The file name is not a path: TorchDynamo tokenizes the file a traced function
    # comes from as Python, which a README is not.
    blocks = [
        "\n" * text.count("\n", 0, match.start(1)) + match.group(1)
        for match in re.finditer(r"```python\n(.*?)```", text, flags=re.S)
    ]
    assert len(blocks) >= 3, "the README tutorial lost its code blocks"
    namespace: dict[str, object] = {}
    try:
        import torch  # the rlx.torch blocks run only where torch is installed
    except ImportError:
        blocks = [block for block in blocks if "import rlx.torch" not in block]
    else:
        # As in the fresh process a reader runs it in: earlier tests' graphs leave TorchDynamo's
        # caches and the backend's fallback record behind (the README asserts there are none).
        from rlx.torch import dynamo

        torch._dynamo.reset()
        dynamo.fallbacks.clear()
        dynamo.stats.update(compiled=0, eager=0)
    for block in blocks:
        exec(compile(block, "<README.md>", "exec"), namespace)
    assert "exe" in namespace and "expected" in namespace

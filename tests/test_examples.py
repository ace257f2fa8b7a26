"""The training examples, in a short form: loss curves against torch SDPA, rt.compile, and DDP.

Optional (torch); the data-parallel run starts two processes with torchrun and is marked slow.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import char_lm_rlx_graph  # noqa: E402
import char_lm_torch  # noqa: E402

README = EXAMPLES.parent / "README.md"


def small_config() -> char_lm_torch.Config:
    _, vocab = char_lm_torch.load_text(README)
    return char_lm_torch.Config(vocab=vocab, seq=32, batch=8, embed=32, heads=2, layers=2)


def test_loss_curve_matches_torch_sdpa_over_50_steps() -> None:
    result = char_lm_torch.compare(README, steps=50, seed=0, config=small_config())
    assert result["max_rel_diff"] < 1e-3, result["max_rel_diff"]
    losses = result["losses"]["rlx"]
    assert losses[-1] < losses[0] - 0.5  # it learns
    assert all(rate > 0 for rate in result["tokens_per_s"].values())


def test_rlx_graph_through_rt_compile_trains() -> None:
    losses, rate = char_lm_rlx_graph.train(README, steps=20, seed=0, config=small_config())
    assert losses[-1] < losses[0] - 0.3
    assert rate > 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
                    reason="torchrun not found")  # fmt: skip
def test_data_parallel_gradients_equal_single_process(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    saved = tmp_path / "grads.pt"
    subprocess.run(
        [torchrun, "--nproc_per_node=2", "--master_port=29531", str(EXAMPLES / "char_lm_torch.py"),
         "--distributed", "--save-grads", str(saved)],
        check=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    grads = torch.load(saved)
    for name, reference in grads["single"].items():
        scale = reference.abs().max().item() + 1e-30
        assert (grads["ddp"][name] - reference).abs().max().item() / scale < 1e-5, name

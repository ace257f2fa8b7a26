"""``rlx demo --lm``: train the tiny character-level LM of :mod:`rlx.models` on a text file.

The whole step (forward, loss and every gradient) is one compiled rlx graph; AdamW runs in
NumPy. A progress bar shows the falling loss and tokens/s; a sample is generated at the end.
The text defaults to the project's README (read from the installed package's metadata when the
file itself is not at hand).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TextIO

import numpy as np

import rlx
from rlx.errors import RlxValueError
from rlx.models import LMConfig, char_lm, char_lm_logits, init_params


def default_text() -> tuple[str, str]:
    """The project's README: the file beside the sources, else the package metadata's description."""
    for candidate in (Path.cwd() / "README.md", Path(__file__).resolve().parents[1] / "README.md"):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8"), str(candidate)
    description = metadata.metadata("rlx").get_payload()  # type: ignore[attr-defined]
    if isinstance(description, str) and description.strip():
        return description, "the README in rlx's package metadata"
    raise RlxValueError("no README found to train on; pass --data PATH")


@dataclass
class AdamW:
    """Decoupled weight decay Adam (Loshchilov & Hutter), as torch.optim.AdamW's defaults."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    weight_decay: float = 0.01
    step_count: int = 0

    def __post_init__(self) -> None:
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: float) -> None:
        self.step_count += 1
        b1, b2 = self.betas
        for name, value in params.items():
            g = grads[name]
            m = self.m.setdefault(name, np.zeros_like(value))
            v = self.v.setdefault(name, np.zeros_like(value))
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            m_hat = m / (1 - b1**self.step_count)
            v_hat = v / (1 - b2**self.step_count)
            decay = self.weight_decay if value.ndim == 2 and not name.endswith(("embed", "position")) else 0.0
            value *= 1 - lr * decay
            value -= (lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(np.float32)


def train(
    text: str,
    source: str,
    steps: int,
    batch: int,
    seq: int,
    embed: int,
    heads: int,
    layers: int,
    lr: float,
    seed: int,
    out: TextIO,
    sample_chars: int = 200,
) -> float:
    """Train and print progress; returns the final loss (mean of the last 10 steps)."""
    chars = sorted(set(text))
    if len(text) < seq + 2:
        raise RlxValueError(f"the text from {source} has {len(text)} characters; it needs at least {seq + 2}")
    index = {c: i for i, c in enumerate(chars)}
    data = np.array([index[c] for c in text], dtype=np.int32)
    config = LMConfig(vocab=len(chars), seq=seq, batch=batch, embed=embed, heads=heads, layers=layers)
    g, loss, params = char_lm(config)
    grads = rlx.grad(g, loss, params)
    g.output(loss=loss, **{f"d.{p.node.attrs.name}": d for p, d in zip(params, grads, strict=True)})
    start = time.perf_counter()
    step_exe = rlx.compile(g)
    print(
        f"== tiny char LM on {source}: {len(text)} chars, vocab {len(chars)}, {layers} blocks, E={embed}, "
        f"H={heads}, S={seq}, batch {batch}; {sum(int(np.prod(p.static_shape)) for p in params):,} parameters",
        file=out,
    )
    print(
        f"   one training step = {len(g)} graph nodes -> {len(step_exe.kernels)} kernels; "
        f"compiled in {time.perf_counter() - start:.2f} s",
        file=out,
    )
    values = init_params(g, params, seed)
    rng = np.random.default_rng(seed)
    optimizer = AdamW(lr=lr)
    losses: list[float] = []
    # A terminal gets one progress line redrawn in place; a log or a pipe gets a line per tenth.
    live = bool(getattr(out, "isatty", lambda: False)())
    every = 5 if live else max(1, steps // 10)
    begin = time.perf_counter()
    for step in range(1, steps + 1):
        starts = rng.integers(0, len(data) - seq - 1, batch)
        tokens = np.stack([data[s : s + seq] for s in starts])
        targets = np.stack([data[s + 1 : s + seq + 1] for s in starts])
        result = step_exe(tokens=tokens, targets=targets, **values)
        losses.append(float(result["loss"]))
        warm = min(1.0, step / 20)
        decay = 0.5 * (1 + math.cos(math.pi * step / steps))
        optimizer.step(values, {name: result[f"d.{name}"] for name in values}, lr * warm * (0.1 + 0.9 * decay))
        if step % every == 0 or step == steps:
            elapsed = time.perf_counter() - begin
            done = int(30 * step / steps)
            print(
                ("\r" if live else "") + f"   [{'#' * done}{'.' * (30 - done)}] step {step}/{steps}  "
                f"loss {np.mean(losses[-5:]):.3f}  {step * batch * seq / elapsed:,.0f} tokens/s",
                end="" if live else "\n",
                file=out,
                flush=True,
            )
    if live:
        print(file=out)
    print(
        f"   loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f} (uniform guess: {math.log(len(chars)):.3f})", file=out
    )
    print(f"== sample (temperature 0.8):\n{generate(config, values, chars, data[:seq], sample_chars, rng)}", file=out)
    return float(np.mean(losses[-10:]))


def generate(
    config: LMConfig,
    values: dict[str, np.ndarray],
    chars: list[str],
    prompt: np.ndarray,
    count: int,
    rng: np.random.Generator,
    temperature: float = 0.8,
) -> str:
    """Sample ``count`` characters, feeding the last ``seq`` characters back each time."""
    g, logits = char_lm_logits(config, batch=1)
    g.output(logits=logits)
    exe = rlx.compile(g)
    window = list(prompt[-config.seq :])
    produced = []
    for _ in range(count):
        out = exe(tokens=np.array([window], dtype=np.int32), **values)["logits"][0, -1].astype(np.float64)
        p = np.exp((out - out.max()) / temperature)
        choice = int(rng.choice(len(chars), p=p / p.sum()))
        produced.append(chars[choice])
        window = window[1:] + [choice]
    return "".join(produced)

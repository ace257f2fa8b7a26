"""Train a small character-level transformer written in PyTorch, with attention through rlx.

    python examples/char_lm_torch.py                      # rlx attention vs torch SDPA, same seed
    python examples/char_lm_torch.py --data my.txt --steps 200
    torchrun --nproc_per_node=2 examples/char_lm_torch.py --distributed   # DDP on gloo, 2 processes

The model (embedding + learned positions, pre-norm blocks with RMSNorm, fused QKV, causal
attention, SwiGLU, final norm, LM head) is plain torch; only attention differs between the two
runs: ``rlx.torch.scaled_dot_product_attention`` or ``torch.nn.functional.scaled_dot_product_attention``.
Both start from the same weights and see the same batches, so their loss curves agree to float32
rounding; each prints its tokens/s. With ``--distributed`` the rlx model trains under
DistributedDataParallel, each process on its share of every batch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import rlx.torch as rt

REPO = Path(__file__).resolve().parents[1]
Attention = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Config:
    vocab: int
    seq: int = 64
    batch: int = 16
    embed: int = 64
    heads: int = 4
    layers: int = 2
    lr: float = 3e-3


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class Block(nn.Module):
    def __init__(self, config: Config, attention: Attention) -> None:
        super().__init__()
        e, hidden = config.embed, 64 * math.ceil(8 * config.embed / 3 / 64)
        self.heads, self.attention = config.heads, attention
        self.attn_norm = nn.Parameter(torch.ones(e))
        self.wqkv = nn.Parameter(torch.empty(e, 3 * e))
        self.wo = nn.Parameter(torch.empty(e, e))
        self.mlp_norm = nn.Parameter(torch.ones(e))
        self.w1 = nn.Parameter(torch.empty(e, hidden))
        self.w3 = nn.Parameter(torch.empty(e, hidden))
        self.w2 = nn.Parameter(torch.empty(hidden, e))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, e = x.shape
        q, k, v = (rms_norm(x, self.attn_norm) @ self.wqkv).split(e, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, e // self.heads).transpose(1, 2) for t in (q, k, v))
        att = self.attention(q, k, v, is_causal=True)  # [B, H, S, D], torch's layout
        h = x + att.transpose(1, 2).reshape(b, s, e) @ self.wo
        n = rms_norm(h, self.mlp_norm)
        return h + (F.silu(n @ self.w1) * (n @ self.w3)) @ self.w2


class CharLM(nn.Module):
    def __init__(self, config: Config, attention: Attention) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.empty(config.vocab, config.embed))
        self.position = nn.Parameter(torch.empty(config.seq, config.embed))
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.layers))
        self.final_norm = nn.Parameter(torch.ones(config.embed))
        self.head = nn.Parameter(torch.empty(config.embed, config.vocab))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed[tokens] + self.position
        for block in self.blocks:
            x = block(x)
        logits = rms_norm(x, self.final_norm) @ self.head
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def init_weights(model: CharLM, seed: int) -> None:
    """Norms 1, embeddings N(0, 0.02), matrices N(0, 1/fan_in) (output projections scaled down)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm"):
                p.fill_(1.0)
            elif name in ("embed", "position"):
                p.copy_(0.02 * torch.randn(p.shape, generator=generator))
            else:
                scale = 1.0 / math.sqrt(p.shape[0])
                if name.endswith(("wo", "w2")):
                    scale /= math.sqrt(2 * len(model.blocks))
                p.copy_(scale * torch.randn(p.shape, generator=generator))


def load_text(path: Path) -> tuple[np.ndarray, int]:
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    alphabet, ids = np.unique(data, return_inverse=True)
    return ids.astype(np.int64), len(alphabet)


def batches(ids: np.ndarray, config: Config, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same ``steps`` batches for every run: random windows of the text and their next characters."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - config.seq - 1, config.batch)
        window = np.stack([ids[s : s + config.seq + 1] for s in starts])
        out.append((torch.from_numpy(window[:, :-1].copy()), torch.from_numpy(window[:, 1:].copy())))
    return out


def train(
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    parameters: Iterable[nn.Parameter],
    data: list[tuple[torch.Tensor, torch.Tensor]],
    config: Config,
    log: Any = None,
) -> tuple[list[float], float, float]:
    """AdamW on ``parameters`` over the batches, minimising ``loss_of(tokens, targets)``; returns
    the loss of every step, the tokens/s of the steps after the first, and the first step's
    seconds (apart: with rlx attention it compiles the kernels)."""
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=0.01)
    losses = []
    start = first = time.perf_counter()
    for step, (tokens, targets) in enumerate(data):
        loss = loss_of(tokens, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == 0:
            first = time.perf_counter()
        if log is not None and (step % 10 == 0 or step == len(data) - 1):
            print(f"  step {step:4d}  loss {losses[-1]:.4f}", file=log, flush=True)
    elapsed = time.perf_counter() - first
    tokens_total = sum(t.numel() for t, _ in data[1:])
    return losses, tokens_total / elapsed if elapsed > 0 and tokens_total else 0.0, first - start


def compare(data_path: Path, steps: int, seed: int = 0, config: Config | None = None) -> dict[str, Any]:
    """Train the rlx-attention model and the SDPA model from the same start on the same batches."""
    ids, vocab = load_text(data_path)
    config = config or Config(vocab=vocab)
    data = batches(ids, config, steps, seed)
    runs = {}
    for label, attention in (("rlx", rt.scaled_dot_product_attention), ("torch", F.scaled_dot_product_attention)):
        torch.manual_seed(seed)
        model = CharLM(config, attention)
        init_weights(model, seed)
        print(f"{label} attention:", flush=True)
        runs[label] = train(model, model.parameters(), data, config, log=sys.stdout)
    rlx_losses, torch_losses = runs["rlx"][0], runs["torch"][0]
    worst = max(abs(a - b) / abs(b) for a, b in zip(rlx_losses, torch_losses, strict=True))
    return {
        "losses": {k: v[0] for k, v in runs.items()},
        "tokens_per_s": {k: v[1] for k, v in runs.items()},
        "first_step_s": {k: v[2] for k, v in runs.items()},
        "max_rel_diff": worst,
    }


# ----------------------------------------------------------------------------- data parallel


def distributed_step(data_path: Path, seed: int, config: Config | None = None) -> dict[str, torch.Tensor]:
    """One DDP step on gloo: this rank's half of the batch; returns the averaged gradients."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, vocab = load_text(data_path)
    config = config or Config(vocab=vocab)
    tokens, targets = batches(ids, config, 1, seed)[0]
    share = config.batch // world
    model = CharLM(config, rt.scaled_dot_product_attention)
    init_weights(model, seed)
    ddp = DistributedDataParallel(model)
    loss = ddp(tokens[rank * share : (rank + 1) * share], targets[rank * share : (rank + 1) * share])
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    # Tear down in order: DDP's reducer holds the process group, and freeing the last reference
    # to a gloo group joins its worker thread with the GIL held. Dropped after destroy (when the
    # function returns), that join can wait forever on a worker still finishing a callback that
    # needs the GIL; seen here as a hang in one of two runs. So: DDP first, then a barrier (every
    # earlier work item done), then the group.
    del ddp, loss
    dist.barrier()
    dist.destroy_process_group()
    return grads


def single_process_grads(data_path: Path, seed: int, config: Config | None = None) -> dict[str, torch.Tensor]:
    """The same step in one process on the whole batch (what DDP's averaged gradients must equal)."""
    ids, vocab = load_text(data_path)
    config = config or Config(vocab=vocab)
    tokens, targets = batches(ids, config, 1, seed)[0]
    model = CharLM(config, rt.scaled_dot_product_attention)
    init_weights(model, seed)
    model(tokens, targets).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO / "README.md", help="text file (default: the README)")
    parser.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--distributed", action="store_true", help="one DDP step under torchrun (gloo)")
    parser.add_argument("--save-grads", type=Path, help="with --distributed: rank 0 saves the gradients here")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if args.distributed:
        grads = distributed_step(args.data, args.seed)
        if int(os.environ.get("RANK", "0")) == 0:
            reference = single_process_grads(args.data, args.seed)
            worst = max((grads[n] - reference[n]).abs().max().item() / (reference[n].abs().max().item() + 1e-30)
                        for n in grads)  # fmt: skip
            print(f"DDP (2 processes, gloo) vs one process: max relative gradient difference {worst:.2e}")
            if args.save_grads:
                torch.save({"ddp": grads, "single": reference}, args.save_grads)
        return 0
    result = compare(args.data, args.steps, args.seed)
    final = {label: losses[-1] for label, losses in result["losses"].items()}
    print(f"\nloss after {args.steps} steps: rlx {final['rlx']:.4f}, torch {final['torch']:.4f}")
    print(f"max relative loss difference over the run: {result['max_rel_diff']:.2e}")
    for label, rate in result["tokens_per_s"].items():
        first = result["first_step_s"][label]
        print(f"tokens/s with {label} attention: {rate:,.0f} (after the first step, which took {first:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

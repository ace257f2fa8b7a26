"""How many threads an attention call from torch runs on, and sharing torch's OpenMP threads."""

from __future__ import annotations

import os

import torch

from rlx.codegen.pool import openmp_in_use, use_openmp


def loaded_openmp() -> str | None:
    """The path of the GNU OpenMP runtime (libgomp) loaded in this process, if any: torch's."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith("libgomp"):
                    return path
    except OSError:
        pass
    return None


def share_torch_threads(enabled: bool = True) -> bool:
    """Run rlx's multi-threaded calls on torch's OpenMP threads (the default once ``rlx.torch``
    is imported; ``RLX_TORCH_OPENMP=0`` leaves rlx on its own workers). Returns whether it does.

    torch's workers spin for a while after each of its ops; rlx's own workers would wait for the
    cores they hold (an attention call right after a torch op took 21 ms instead of 17 on two
    cores), and a call with little work paid more to start its threads than it gained. On one
    team, a call right after torch's ops finds the workers awake. Each region has torch's team
    size (``torch.get_num_threads()``, at most the executable's threads); when torch runs one
    thread (``OMP_NUM_THREADS=1`` under torchrun) rlx's calls use its own workers.
    """
    library = loaded_openmp() if enabled and torch.backends.openmp.is_available() else None
    return use_openmp(library)


SMALL_ATTENTION_FLOPS = 1 << 18
"""Below this many FLOPs an attention call runs on the calling thread (on torch's threads).

Measured with a torch matmul before each call, as in a model, on two cores: from ~1 MFLOP up
two threads win on torch's OpenMP team (B4 H4 S32 D16: 85 us against 95; the char LM's B16
H4 S64 D16: 322 against 539). Below that it was even until the call's Python got shorter: in
a model's decode step (a QKV projection, the KV cache's ``torch.cat``, attention, the output
projection; B1 H8 D64, Intel Xeon), two threads from 2^18 FLOPs (128 keys) on ran attention
100-200 keys 109 us against 117, 200-300 116 against 135, 400-500 147 against 173 (medians of
three runs; 2^16 was no better, and under 100 keys the call is its Python).
"""

SMALL_ATTENTION_FLOPS_OWN_WORKERS = 1 << 26
"""The same threshold when rlx runs on its own workers (``RLX_TORCH_OPENMP=0``, or torch without
GNU OpenMP). They compete with torch's workers, which keep spinning after torch's ops: on the
char-LM example two threads made the run 1.5x slower than one, and a decode step 3x slower.
"""


def _threads_for(flops: float) -> int | None:
    """One thread for small attention calls (see :data:`SMALL_ATTENTION_FLOPS`), else all.

    A cap on the call, not a build: one executable serves both, so a decode loop or a batch of
    a new length crossing the threshold compiles nothing.
    """
    small = SMALL_ATTENTION_FLOPS if openmp_in_use() else SMALL_ATTENTION_FLOPS_OWN_WORKERS
    return 1 if flops < small else None


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    return 2.0 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * (q.shape[3] + v.shape[3])

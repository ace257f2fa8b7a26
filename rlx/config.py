"""Runtime configuration shared by the reference interpreter and compiled code."""

from __future__ import annotations

import functools
import math
import numbers
import os
from dataclasses import dataclass, fields, replace

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError


@dataclass(frozen=True)
class RuntimeConfig:
    """Numeric and threading knobs.

    ``attn_mask_neg_inf`` is the score written where a mask hides a key (``-inf`` gives the
    safe softmax: fully masked rows produce zeros). ``mask_binary_threshold`` decides which
    key-padding entries are masked (``mask < threshold``). ``num_threads=None`` means
    ``RLX_NUM_THREADS`` or else every core.
    """

    attn_mask_neg_inf: float = -1e9
    mask_binary_threshold: float = 0.5
    num_threads: int | None = None

    def __post_init__(self) -> None:
        # Fields are normalised to Python floats / ints (NumPy scalars accepted) so that equal
        # settings compare and hash equal: the compile cache keys on the config.
        for name in ("attn_mask_neg_inf", "mask_binary_threshold"):
            value = getattr(self, name)
            if _is_bool(value) or not isinstance(value, numbers.Real):
                raise RlxTypeError(f"RuntimeConfig.{name} must be a float, got {type(value).__name__}")
            try:
                object.__setattr__(self, name, float(value))
            except OverflowError:  # an int beyond the float range
                raise RlxValueError(f"RuntimeConfig.{name} must fit in a float, got {value}") from None
        if math.isnan(self.attn_mask_neg_inf) or self.attn_mask_neg_inf > 0:
            raise RlxValueError(
                f"RuntimeConfig.attn_mask_neg_inf must be a non-positive number or -inf, got {self.attn_mask_neg_inf}"
            )
        if math.isnan(self.mask_binary_threshold):
            raise RlxValueError("RuntimeConfig.mask_binary_threshold must not be NaN")
        if self.num_threads is not None:
            if _is_bool(self.num_threads) or not isinstance(self.num_threads, numbers.Integral):
                raise RlxTypeError(
                    f"RuntimeConfig.num_threads must be an int or None, got {type(self.num_threads).__name__}"
                )
            object.__setattr__(self, "num_threads", int(self.num_threads))
            if self.num_threads < 1:
                raise RlxValueError(f"RuntimeConfig.num_threads must be >= 1, got {self.num_threads}")

    def with_overrides(self, **changes: object) -> RuntimeConfig:
        """A copy with some fields changed (validated like the constructor)."""
        known = [field.name for field in fields(self)]
        for name in changes:
            if name not in known:
                raise RlxTypeError(f"RuntimeConfig has no field {name!r}; fields: {', '.join(known)}")
        return replace(self, **changes)  # type: ignore[arg-type]


def _is_bool(value: object) -> bool:
    return isinstance(value, (bool, np.bool_))


def resolve_config(config: RuntimeConfig | None) -> RuntimeConfig:
    """Check the user's config argument and fill the default."""
    if config is None:
        return RuntimeConfig()
    if not isinstance(config, RuntimeConfig):
        raise RlxTypeError(f"config must be an rlx.RuntimeConfig, got {type(config).__name__}")
    return config


def resolve_num_threads(config: RuntimeConfig) -> int:
    """Threads for the parallel region: config, then ``RLX_NUM_THREADS``, then every core.

    ``RLX_ATTN_BWD_SERIAL=1`` forces one thread whatever else says, for A/B measurements.
    """
    if os.environ.get("RLX_ATTN_BWD_SERIAL", "").strip() not in ("", "0"):
        return 1
    if config.num_threads is not None:
        return config.num_threads
    env = os.environ.get("RLX_NUM_THREADS", "").strip()
    if env:
        # Plain ASCII digits only: int() would also take "+4", "4_0" and non-ASCII digits.
        if not (env.isascii() and env.isdigit()) or int(env) < 1:
            raise RlxValueError(f"RLX_NUM_THREADS must be a positive integer, got {env!r}")
        return int(env)
    return _available_cores()


def _available_cores() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@functools.cache
def machine_cores() -> int:
    """The cores this process may run on, read once: what work that must split the same way for
    every thread count (a matmul's blocks) is split for, so it never changes within a process."""
    return _available_cores()


@functools.cache
def l2_cache_bytes() -> int:
    """The L2 caches of the cores this process runs on, together (read once from sysfs; 1 MiB a
    core where the kernel does not say). A kernel whose operands and outputs exceed this finds
    its outputs out of cache when it writes them, which is when streaming stores pay
    (``lower.streaming``)."""
    per_core = 1 << 20
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(root)):
            with open(os.path.join(root, index, "level")) as level:
                if level.read().strip() != "2":
                    continue
            with open(os.path.join(root, index, "size")) as size:
                text = size.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
            per_core = int(text.rstrip("KM")) * scale
            break
    except (OSError, ValueError):
        pass
    return per_core * machine_cores()

"""torch tensors to and from the NumPy arrays rlx's executables take: no copy for contiguous float32."""

from __future__ import annotations

import numpy as np
import torch

from rlx.errors import RlxTypeError

_COMPUTED = (torch.float32, torch.float16, torch.bfloat16)
_CPU = torch.device("cpu")  # for _written: parsing "cpu" on every call cost a decode step 0.25 us


def _check_tensor(tensor: object, name: str, kinds: str = "float") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise RlxTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu:  # (tensor.device.type costs 0.4 us a call; this, 0.07)
        raise RlxTypeError(f"{name} is on device {tensor.device}; rlx runs on the CPU (move it with .cpu())")
    if tensor.layout is not torch.strided or tensor.is_nested:  # sparse, mkldnn, nested: no plain memory
        layout = "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.").strip("_")
        raise RlxTypeError(f"{name} is a {layout} tensor; rlx takes dense (strided) tensors: pass {name}.to_dense()")
    if kinds == "float" and tensor.dtype not in _COMPUTED:
        raise RlxTypeError(f"{name} has dtype {tensor.dtype}; rlx.torch takes float32, float16 or bfloat16")
    return tensor


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A float32 (or int/bool) NumPy view of a CPU tensor: no copy when it is contiguous float32."""
    x = tensor.detach() if tensor.requires_grad else tensor
    if x.dtype == torch.float32:
        pass  # the common case: each call below costs a microsecond even when it does nothing
    elif x.is_floating_point():
        x = x.float()  # half precisions are computed in float32
    elif x.dtype not in (torch.int32, torch.int64, torch.bool):
        x = x.to(torch.int64)  # int8/int16/uint8 index tensors
    return (x if x.is_contiguous() else x.contiguous()).numpy()


def _direct(*tensors: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether native code may read these tensors' memory as it is: dense CPU tensors of
    ``dtype``, C-contiguous and aligned to their elements (for float32, what ``_array`` would
    view without a copy)."""
    for t in tensors:  # a loop, not all() of a generator: one frame less on every decode step
        if t.layout is not torch.strided or t.is_nested or t.dtype != dtype or not t.is_cpu:
            return False
        if not t.is_contiguous() or t.data_ptr() % t.element_size() or t.is_neg():
            return False
    return True


def _dense(*tensors: torch.Tensor) -> list[torch.Tensor] | None:
    """Float32 tensors as native code may read them by address (:func:`_direct`), strided ones
    copied contiguous by torch (as :func:`_array` would copy them); None for any other dtype."""
    if any(t.dtype != torch.float32 for t in tensors):
        return None
    dense = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    return dense if _direct(*dense) else None


def _written(shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A new tensor for native code to write: float32 and on the CPU whatever torch's default
    dtype and device (under ``torch.set_default_dtype(torch.float64)`` a default ``torch.empty``
    held float32 bit patterns as float64; under ``set_default_device("meta")`` it had no memory)."""
    return torch.empty(shape, dtype=torch.float32, device=_CPU)


def _tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    out = torch.from_numpy(array)
    return out if dtype == torch.float32 else out.to(dtype)


def _rlx_dtype(tensor: torch.Tensor) -> str:
    if tensor.is_floating_point():
        return "float32"
    if tensor.dtype == torch.bool:
        return "bool"
    return "int32" if tensor.dtype == torch.int32 else "int64"


def _float(tensor: torch.Tensor) -> torch.Tensor:
    """float16 and bfloat16 as float32 (rlx computes in float32), differentiably; others as they are."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor

"""The two device facts the CUDA-only code paths read, in one place each, so that tests can run those paths on fake
CUDA tensors (``torch._subclasses.fake_tensor.FakeTensorMode``) on a CPU-only build of torch.

Under ``FakeTensorMode`` a tensor made with ``device="cuda"`` carries shapes, strides and dtypes through torch's own
shape checks (the meta kernels of ``scaled_mm``, ``_scaled_grouped_mm``, ``_grouped_mm``, SDPA) without a GPU. Two
things still need the CUDA runtime, and moetrain reads them only through this module:

* the compute capability of the device (``torch.cuda.get_device_capability`` raises without a driver): tests patch
  :func:`cuda_capability` to pose as a Hopper (9, 0) or Blackwell (10, 0) GPU;
* a few Python bindings enter a device guard, which a CPU-only build has no implementation of for CUDA ("PyTorch is
  not linked with support for cuda devices"; torch 2.13 CPU): ``Tensor.contiguous()``, ``Tensor.copy_()`` and
  indexing (``t[...]``, reading or writing). :func:`contiguous` makes the same copy through ``clone``, which the
  dispatcher serves without that guard, and the CUDA paths index with ``select`` / ``narrow`` / ``index_select``.
  The autograd engine needs the guard too (building a graph over fake CUDA leaves aborts the process on torch 2.13
  CPU; torch 2.11's CUDA build without a driver raises "hasPrimaryContext"), so the tests call autograd Functions'
  ``forward`` and ``backward`` themselves.
"""

from __future__ import annotations

import torch


def cuda_capability(device: torch.device | str | int | None = None) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device (``torch.cuda.get_device_capability``); e.g. (9, 0) for
    an H100/H200. Raises what torch raises without a CUDA driver (tests on fake CUDA tensors patch this function)."""
    return torch.cuda.get_device_capability(device)


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``: ``t`` itself when already contiguous, else a row-major copy, made with
    ``clone(memory_format=torch.contiguous_format)`` (same result; see the module docstring for why)."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)

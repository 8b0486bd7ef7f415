"""Host-to-device uploads that never make the host wait for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory, which synchronises with the stream: the host
would stall until the previous step's kernel finished, and the engine could not prepare step t+1 while the GPU runs
step t. Uploading from pinned memory with `non_blocking=True` only enqueues the copy. PyTorch's pinned-memory
allocator keeps the staging buffer alive until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a list or a CPU tensor) as a tensor on `device`, without a host/device synchronisation."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(dtype=dtype)
    return t.to(dtype=dtype).pin_memory().to(device, non_blocking=True)

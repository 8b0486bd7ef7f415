"""The CUDA-graph decode backend: a conventional decode step (cuBLAS projections, Triton attention, routing and
expert kernels) captured once per batch bucket and replayed every step. It runs on any CUDA GPU Triton supports,
and it is the honest baseline the megakernel is measured against (`megakernel.graph.backend.GraphBackend`)."""

from __future__ import annotations

import torch


def graph_available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """(True, "") when the graph backend can run on `device`, else (False, reason). Imports no Triton code."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if device is not None and torch.device(device).type != "cuda":
        return False, f"device {device} is not a CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    return True, ""

"""Cross-device block copies at link speed (see ``StagedCopier``).

``tensor_device(t)`` is the one place kvtier asks where a tensor lives, so that a test
stand-in for ``torch.cuda`` can place CPU tensors on a pretend device.
"""

from __future__ import annotations

import torch

__all__ = ["tensor_device"]


def tensor_device(t: torch.Tensor) -> torch.device:
    """The device ``t`` lives on."""
    return t.device

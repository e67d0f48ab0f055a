"""The tools layer: what an operator runs from a shell.

It owns the ``kvtier`` command line (``cli``), the offline inspect / verify tools over a
persistent tier's directory (``offline``) and ``kvtier bench`` (``bench``). Nothing below it
imports it; it never runs inside an engine's step.
"""

from typing import TYPE_CHECKING

from kvtier._lazy import lazy_exports

if TYPE_CHECKING:
    from kvtier.tools.offline import TierReport, VerifyReport, detect_tier, find_tiers, inspect_tier, verify_tier

# Imported on first use: the kvtier command starts without importing torch.
__getattr__, __dir__ = lazy_exports(
    __name__, dict.fromkeys(["TierReport", "VerifyReport", "detect_tier", "find_tiers", "inspect_tier", "verify_tier"], "kvtier.tools.offline")
)

__all__ = ["TierReport", "VerifyReport", "detect_tier", "find_tiers", "inspect_tier", "verify_tier"]

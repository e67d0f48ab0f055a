"""The tools layer: what an operator runs from a shell.

It owns the ``kvtier`` command line (``cli``), the offline inspect / verify tools over a
persistent tier's directory (``offline``) and ``kvtier bench`` (``bench``). Nothing below it
imports it; it never runs inside an engine's step.
"""

from kvtier.tools.offline import TierReport, VerifyReport, detect_tier, find_tiers, inspect_tier, verify_tier

__all__ = ["TierReport", "VerifyReport", "detect_tier", "find_tiers", "inspect_tier", "verify_tier"]

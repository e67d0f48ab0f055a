"""The manager layer: which key is where, across the ordered tiers (fastest first).

It owns key state, slot reservations, pins, eviction order (through a policy), admission,
promotion and the event log. It never moves a byte, blocks, awaits, or imports config, the
connector, a transfer or a backend module: plans it hands out are carried out by others.
"""

from kvtier.manager.tier_manager import (
    CacheEvent,
    Demotion,
    KeyState,
    KeyStatus,
    LoadPlan,
    StorePlan,
    TierManager,
    TierSpec,
)

__all__ = ["TierSpec", "TierManager", "StorePlan", "LoadPlan", "Demotion", "KeyState", "KeyStatus", "CacheEvent"]

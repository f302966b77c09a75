"""What a killed job left: the committed steps of a RAM directory and an object tier, as a store lists them."""

from tierfs import TieredStore
from tierfs.tiers import MemoryTier, ObjectTier


def committed(ram: str, obj_url: str) -> dict[int, list[str]]:
    """``{step: [tier names]}`` of the steps committed in ``ram`` (tier "ram") and at ``obj_url`` ("file")."""
    store = TieredStore([MemoryTier(ram), ObjectTier(obj_url)], cleanup=False)
    try:
        return store.steps()
    finally:
        store.close()

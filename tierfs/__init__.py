"""tierfs: fast, safe checkpointing across RAM, peer and object-storage tiers."""

from .errors import (ArgumentError, BackgroundError, CapacityError, CheckpointLostError, ChecksumError, DeviceError,
                     FormatError, HelperError, RestoreError, RestoreIncompleteError, StateMismatchError, StepExistsError,
                     StepNotFoundError, TierfsError, TierUnavailableError)
from .store import RestoreInfo, TieredStore
from .adapters.manager import CheckpointManager, CheckpointManagerOptions

__version__ = "0.1.0"

__all__ = [
    "ArgumentError", "BackgroundError", "CapacityError", "CheckpointLostError", "CheckpointManager",
    "CheckpointManagerOptions", "ChecksumError", "DeviceError", "FormatError", "HelperError", "RestoreError", "RestoreIncompleteError", "RestoreInfo",
    "StateMismatchError", "StepExistsError", "StepNotFoundError", "TierUnavailableError", "TieredStore",
    "TierfsError",
]

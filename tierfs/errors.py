"""Exceptions raised by tierfs. Every message is one line and says what to do."""

from __future__ import annotations


class TierfsError(Exception):
    """Base class of every error tierfs raises on purpose."""


class FormatError(TierfsError):
    """A manifest, marker or name on a tier is malformed or unsafe."""


class ChecksumError(TierfsError):
    """Bytes read from a tier do not match the crc32c recorded at save time."""


class CapacityError(TierfsError):
    """A save would exceed a tier's budget or free space; nothing was written."""


class TierUnavailableError(TierfsError):
    """A tier cannot be reached: bad URL, missing bucket, bad credentials."""


class StepNotFoundError(TierfsError):
    """The requested step is not committed on any usable tier."""


class StepExistsError(TierfsError):
    """A step that is already committed was saved again without ``overwrite=True``."""


class RestoreError(TierfsError):
    """No tier could serve a verified copy of the step."""


class BackgroundError(TierfsError):
    """A background copy or deletion failed; raised by the next call on the store."""


class StateMismatchError(TierfsError, ValueError):
    """The state given to restore into does not match the checkpoint (names, dtypes or shapes)."""

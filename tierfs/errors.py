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


class DeviceError(TierfsError):
    """A copy between device (GPU) memory and the RAM tier failed, e.g. the device ran out of memory."""


class TierUnavailableError(TierfsError):
    """A tier cannot be reached: bad URL, missing bucket, bad credentials."""


class StepNotFoundError(TierfsError):
    """The requested step is not committed on any usable tier."""


class StepExistsError(TierfsError):
    """A step that is already committed was saved again without ``overwrite=True``."""


class OutputExistsError(TierfsError, FileExistsError):
    """An export's destination already holds an export. The message says how to replace it in the caller's
    terms: ``overwrite=True`` in Python; :meth:`on_command_line` gives the same error naming ``--overwrite``."""

    def __init__(self, what: str, argument: str = "overwrite=True") -> None:
        self.what = what
        super().__init__(f"{what}; pass {argument} to replace it")

    def on_command_line(self, flag: str = "--overwrite") -> "OutputExistsError":
        return OutputExistsError(self.what, flag)


class RestoreError(TierfsError):
    """No tier could serve a verified copy of the step."""


class RestoreIncompleteError(RestoreError):
    """Ranks had restored a step and returned when another rank found no verified copy of it (or the
    restore failed to finish): the ranks cannot all move to an older step. Restart the job; its restore
    starts over. Raised on every rank, by a rank that returned at its next call on the store."""


class CheckpointLostError(RestoreError):
    """Ranks hold committed steps, but no step is held by every rank: the shards of the others and every
    copy of them are gone. Raised on every rank by a restore (and by ``CheckpointManager.restore``, which
    returns None only when nothing was ever saved), never read as "nothing to restore". ``steps`` are the
    steps some rank holds; ``lacking`` maps the newest of them to the ranks without them."""

    def __init__(self, message: str, *, steps: list[int] | None = None,
                 lacking: dict[int, list[int]] | None = None) -> None:
        super().__init__(message)
        self.steps, self.lacking = list(steps or []), dict(lacking or {})


class HelperError(TierfsError):
    """A helper process of the rank's (its uploads') ended or failed; the message names it and the step."""


class BackgroundError(TierfsError):
    """A background copy or deletion failed; raised by the next call on the store."""


class ArgumentError(TierfsError, TypeError, ValueError):
    """An argument given to tierfs has the wrong type or value; the message names it and says what is
    expected. It is also a TypeError and a ValueError, so code catching either keeps working."""


class URLArgumentError(ArgumentError, TierUnavailableError):
    """An object-store URL that cannot be one (a typo, an unknown protocol, no bucket): an
    :class:`ArgumentError`, and a :class:`TierUnavailableError` as bad URLs always were."""


class StateMismatchError(TierfsError, ValueError):
    """The state given to restore into does not match the checkpoint (names, dtypes or shapes)."""


class RankWaitError(TierfsError):
    """A wait on another rank ended without it: it did not arrive within the timeout, or its process is
    gone. ``stage`` names what this rank was doing, ``ranks`` the ranks it waited for (None: unknown)."""

    def __init__(self, message: str, *, stage: str | None = None, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.stage, self.ranks = stage, ranks

    @classmethod
    def waiting(cls, stage: str | None, ranks: list[int] | None, timeout: float, why: str) -> "RankWaitError":
        """The error of a wait that failed with backend message ``why``."""
        gone = "closed by peer" in why or "reset by peer" in why
        who = f"rank(s) {ranks}" if ranks else "another rank"
        what = "is gone (its process ended)" if gone else f"did not arrive within {timeout:g} s"
        where = f"{stage}: " if stage else ""
        hint = ("; check its log" if gone else "; it may be stuck or dead: check its log, or raise timeout= if "
                "it is only slow")
        return cls(f"{where}{who} {what}{hint}", stage=stage, ranks=ranks)

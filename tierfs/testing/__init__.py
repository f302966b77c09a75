"""Test support shipped with tierfs, for tierfs's own tests and for third-party tiers.

:class:`TierTests` (:mod:`tierfs.testing.tiers`)
    The conformance suite every :class:`~tierfs.tiers.Tier` passes: subclass it with a ``make_tier``
    fixture for your backend.
:class:`StagingTests`, :class:`SharedDirectoryTests`, :class:`LocalFilesTests`, :class:`ZeroCopyTests`,
:class:`FileDeletesTests` (:mod:`tierfs.testing.capabilities`)
    One suite per capability (:mod:`tierfs.tiers.capabilities`), each a :class:`TierTests` too: a tier
    with a capability adds its suite to its test class.
:class:`ReplicatorTests` (:mod:`tierfs.testing.replicators`)
    The conformance suite of a :class:`~tierfs.tiers.base.Replicator` (the peer tier's role), run in a real
    multi-process gloo job that :mod:`tierfs.testing.launch` starts: subclass it with the name of a
    factory of your replicator.
:func:`assert_states_equal` (:mod:`tierfs.testing.states`)
    Bit-exact comparison of two states, naming the key path of the first difference.
:mod:`tierfs.testing.hooks`
    Run a function of yours at named points of tierfs's work (kill a process mid-transfer, inject a
    failure), without patching internals.

Importing this package imports neither torch nor pytest; the suites import pytest when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import hooks
from .states import assert_states_equal

if TYPE_CHECKING:
    from .capabilities import FileDeletesTests, LocalFilesTests, SharedDirectoryTests, StagingTests, ZeroCopyTests
    from .replicators import ReplicatorTests
    from .tiers import TierTests

__all__ = ["FileDeletesTests", "LocalFilesTests", "ReplicatorTests", "SharedDirectoryTests", "StagingTests", "TierTests",
           "ZeroCopyTests", "assert_states_equal", "hooks"]

_CAPABILITY_SUITES = ("FileDeletesTests", "LocalFilesTests", "SharedDirectoryTests", "StagingTests", "ZeroCopyTests")


def __getattr__(name: str) -> Any:
    if name == "TierTests":
        from .tiers import TierTests

        return TierTests
    if name in _CAPABILITY_SUITES:
        from . import capabilities

        return getattr(capabilities, name)
    if name == "ReplicatorTests":
        from .replicators import ReplicatorTests

        return ReplicatorTests
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

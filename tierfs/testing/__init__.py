"""Test support shipped with tierfs: the conformance suite every tier passes, state comparison, and hooks
at named points of tierfs's work (see :mod:`tierfs.testing.hooks`)."""

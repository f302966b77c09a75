"""How a child process of a gloo test job (tests/gloo_job.py) ends: :func:`tierfs.testing.launch.finish`
(leave the job, print the result line, exit 0 without the interpreter's teardown, which torch 2.13's gloo
aborts now and then after the work is done)."""

from tierfs.testing.launch import finish

__all__ = ["finish"]

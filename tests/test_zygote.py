"""The suite's process starter (tests/_zygote.py): a ``python ...`` command forked from a warm interpreter
behaves as the same command started with exec: arguments, environment, directory, ``sys.path``, standard
streams, exit status, tracebacks, threads and ``atexit`` at the end, signals; commands it does not take
are started with exec."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import _zygote

pytestmark = pytest.mark.skipif(not _zygote._state["on"], reason="the zygote is off (not Linux, or "
                                "TIERFS_TEST_SPAWN=exec)")

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading, time
    import numpy as np
    atexit.register(lambda: print("atexit", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread", flush=True))).start()
    print(__name__, sys.argv[1:], os.getcwd() == os.environ["WANT_CWD"], os.environ.get("ONLY_HERE"))
    print(sys.path[0] == os.path.dirname(os.path.realpath(__file__)), os.environ["EXTRA"] in sys.path)
    print(sys.stdin.readline().strip())
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
""")


def run(cmd, exec_: bool, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, **kw.pop("env", {})}
    if exec_:
        env["TIERFS_TEST_SPAWN"] = "exec"
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, **kw)


@pytest.mark.parametrize("code", [0, 3])
def test_a_script_runs_as_it_does_when_started_with_exec(tmp_path, code):
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    extra = str(tmp_path / "extra")
    env = {"WANT_CWD": str(tmp_path), "ONLY_HERE": "yes", "EXTRA": extra, "PYTHONPATH": extra}
    got = [run([sys.executable, "child.py", str(code), "b"], e, env=env, cwd=tmp_path, input="from stdin\n")
           for e in (False, True)]
    assert got[0].returncode == got[1].returncode == code
    assert got[0].stdout == got[1].stdout == (f"__main__ ['{code}', 'b'] True yes\nTrue True\nfrom stdin\n"
                                              "thread\natexit\n")
    assert got[0].stderr == got[1].stderr == "to stderr\n"


def test_a_failing_command_prints_the_traceback_an_interpreter_prints():
    code = "def f():\n    raise ValueError('boom')\nf()\n"
    zyg, exe = (run([sys.executable, "-c", code], e) for e in (False, True))
    assert zyg.returncode == exe.returncode == 1
    assert zyg.stderr == exe.stderr and exe.stderr.endswith("ValueError: boom\n")
    zyg, exe = (run([sys.executable, "-c", "import sys; sys.exit('no good')"], e) for e in (False, True))
    assert (zyg.returncode, zyg.stderr) == (exe.returncode, exe.stderr) == (1, "no good\n")


def test_modules_run_with_dash_m_and_processes_are_the_test_process_s_children():
    r = run([sys.executable, "-m", "tierfs.cli", "--version"], False)
    assert r.returncode == 0 and r.stdout.startswith("tierfs")
    p = subprocess.Popen([sys.executable, "-c", "import os, time; print(os.getppid(), flush=True); time.sleep(300)"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert int(p.stdout.readline()) == os.getpid()  # forked by a zygote, adopted by this process
        assert p.poll() is None
    finally:
        p.send_signal(signal.SIGKILL)
        assert p.wait(timeout=60) == -signal.SIGKILL
        p.stdout.close()


def test_processes_draw_their_own_random_numbers_and_string_hashes():
    code = "import numpy as np, random; print(np.random.rand(), random.random(), hash('tierfs'))"
    outs = [run([sys.executable, "-c", code], False).stdout.split() for _ in range(3)]
    for k in range(2):  # numpy's and random's states: every process its own
        assert len({o[k] for o in outs}) == 3
    assert len({o[2] for o in outs}) >= 2  # two zygotes take turns: neighbours hash with different seeds


def test_commands_it_does_not_take_are_started_with_exec(tmp_path):
    assert _zygote._request({"args": ["bash", "-c", "true"], "executable": None, "shell": False, "preexec_fn": None,
                             "pass_fds": (), "start_new_session": False, "umask": -1, "gid": None, "gids": None,
                             "uid": None, "close_fds": True, "env": None, "cwd": None}) is None
    r = subprocess.run(["bash", "-c", "echo $0"], capture_output=True, text=True, timeout=60)
    assert r.stdout == "bash\n"
    r = subprocess.run([sys.executable, "-c", "import os; print(os.getsid(0) == os.getpid())"], capture_output=True,
                       text=True, timeout=120, start_new_session=True)
    assert r.stdout == "True\n"  # a new session: exec, as asked

"""Test processes forked from a warm interpreter: the suite's processes start without importing torch.

Most of the suite's CPU time was processes starting ``python script.py`` and importing torch (about 1.6 s
of CPU each, against a few tenths for what a test's rank then does). Here a *zygote* (a Python process
that imported torch, torch.distributed and numpy once) forks each such process instead:

- :class:`Popen` is ``subprocess.Popen`` with one change: a command of the form ``[sys.executable,
  script.py | -m module | -c code, args...]`` with no ``pass_fds``, ``preexec_fn``, new session, user or
  group change is handed to a zygote, with the pipes ``Popen`` made, the environment and the directory.
  Every other command is started as ``subprocess.Popen`` starts it.
- The zygote forks, the fork forks the process and exits, so the process is re-parented to the test
  process (a child subreaper, ``PR_SET_CHILD_SUBREAPER``) before it runs anything: it is the test
  process's child, and
  ``wait``, ``poll``, ``communicate``, ``kill`` and return codes are ``subprocess``'s own.
- The process is a real, separate OS process: it sets its own environment, ``sys.argv``, ``sys.path``
  (its ``PYTHONPATH``) and standard streams, runs the script as ``__main__``, and at its end waits for
  its threads and runs its ``atexit`` functions, as an interpreter does. numpy's global random state is
  seeded afresh (``random``'s is by ``os.fork``); ``OMP_NUM_THREADS`` sets torch's threads. Two zygotes
  take turns, so the ranks of a job (started one after the other) hash strings with different seeds, as
  separate interpreters do.

``conftest.py`` installs it for the session (Linux only; ``TIERFS_TEST_SPAWN=exec`` in the environment
turns it off, in a command's ``env`` for that command: a test of what a fresh interpreter has not imported
yet). A zygote that cannot start or has died is reported once, and processes are then started as usual.
"""

from __future__ import annotations

import array
import ctypes
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
import warnings
from typing import Any

PRELOAD = ("torch", "torch.distributed", "numpy")
_PR_SET_CHILD_SUBREAPER = 36


# -- the zygote's side -------------------------------------------------------------------------------

def serve(fd: int, path: list[str]) -> None:
    """The zygote's loop: one request at a time on the socket ``fd``, until the test process closes it.
    ``path`` is the interpreter's own ``sys.path`` (without the script's directory)."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    base_path = [p for p in path if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    sock = socket.socket(fileno=fd)
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 22, 3)
        except OSError:
            return
        if not data:
            return
        req = json.loads(data)
        r, w = os.pipe()  # the process's pid, from the fork between
        go_r, go_w = os.pipe()  # the process waits on it until it is the test process's child
        first = os.fork()
        if first == 0:
            try:
                pid = os.fork()
                if pid == 0:
                    for f in (r, w, go_w):
                        os.close(f)
                    sock.close()
                    os.read(go_r, 1)
                    os.close(go_r)
                    _run(req, fds, base_path)  # never returns
                os.write(w, str(pid).encode())
            finally:
                os._exit(0)
        for f in (w, go_r):
            os.close(f)
        pid = int(os.read(r, 64) or b"0")
        os.close(r)
        os.waitpid(first, 0)  # its parent has exited: the process is now the test process's child
        os.write(go_w, b"g")
        os.close(go_w)
        for f in fds:
            os.close(f)
        sock.sendall(json.dumps({"pid": pid}).encode())


def _run(req: dict[str, Any], fds: list[int], base_path: list[str]) -> None:
    """In the forked process: become the requested ``python ...`` and exit as an interpreter exits."""
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for name in os.listdir("/proc/self/fd"):  # what the zygote held: only 0, 1 and 2 stay open
            if int(name) > 2:
                try:
                    os.close(int(name))
                except OSError:
                    pass
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        _streams(req["env"])
        kind, what, args = req["kind"], req["what"], req["args"]
        first = {"script": os.path.dirname(os.path.realpath(what)), "module": os.getcwd(), "code": ""}[kind]
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [first, *extra, *base_path]
        sys.argv[:] = [{"script": what, "module": what, "code": "-c"}[kind], *args]
        threads = req["env"].get("OMP_NUM_THREADS", "")
        import numpy as np
        import torch

        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        np.random.seed()
    except BaseException:  # noqa: BLE001 - the process could not be set up: say so on its stderr
        import traceback

        traceback.print_exc()
        os._exit(1)
    code = _main(kind, what)
    os._exit(code)


def _streams(env: dict[str, str]) -> None:
    import io

    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        raw = io.FileIO(fd, "w", closefd=False)
        buf = raw if unbuffered else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(buf, encoding="utf-8", errors=errors, write_through=unbuffered,
                                  line_buffering=name == "stderr" and not unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.__stdin__ = sys.stdin


def _main(kind: str, what: str) -> int:
    import atexit
    import runpy
    import signal
    import types

    code = 0
    interrupted = False
    try:
        if kind == "script":
            runpy.run_path(what, run_name="__main__")
        elif kind == "module":
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(what, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt as e:
        _print_exception(e, runpy.__file__)
        code, interrupted = 1, True
    except BaseException as e:  # noqa: BLE001 - as the interpreter: the traceback on stderr, status 1
        _print_exception(e, runpy.__file__)
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at interpreter exit
    except KeyboardInterrupt:
        pass
    try:
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e.code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _print_exception(e: BaseException, runpy_file: str) -> None:
    """The traceback from the script's first frame, as the interpreter prints it."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy_file):
        tb = tb.tb_next
    sys.excepthook(type(e), e.with_traceback(tb), tb)


def _exit_code(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


# -- the test process's side -------------------------------------------------------------------------

class _Zygote:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # a message per request
        ours.settimeout(300)  # a zygote that does not answer (its first answer waits for its imports)
        self.sock = ours
        self.lock = threading.Lock()
        here = os.path.dirname(os.path.abspath(__file__))
        code = f"import sys; path = [p for p in sys.path if p]; sys.path.insert(0, {here!r}); import _zygote; " \
               f"_zygote.serve({theirs.fileno()}, path)"
        self.proc = _Exec([sys.executable, "-c", code], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL)
        theirs.close()

    def spawn(self, req: dict[str, Any], fds: list[int]) -> int:
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(req).encode()], fds)
            data = self.sock.recv(1 << 16)
        if not data:
            raise OSError("the zygote closed its socket")
        return int(json.loads(data)["pid"])

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_Exec = subprocess.Popen
_zygotes: list[_Zygote] = []
_turn = 0
_state = {"on": False, "broken": ""}
_lock = threading.Lock()


def install() -> bool:
    """Make ``subprocess.Popen`` this module's :class:`Popen` for the process (False where unavailable)."""
    if sys.platform != "linux" or os.environ.get("TIERFS_TEST_SPAWN", "").strip() == "exec":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    _state["on"] = True
    subprocess.Popen = Popen  # type: ignore[misc]
    return True


def uninstall() -> None:
    subprocess.Popen = _Exec  # type: ignore[misc]
    _state["on"] = False
    for z in _zygotes:
        z.close()
    _zygotes.clear()


def _next_zygote() -> _Zygote:
    global _turn
    with _lock:
        if not _zygotes:
            _zygotes.extend(_Zygote() for _ in range(2))
        _turn += 1
        return _zygotes[_turn % len(_zygotes)]


_PARAMS = list(inspect.signature(_Exec._execute_child).parameters)[1:]  # type: ignore[attr-defined]


def _request(a: dict[str, Any]) -> dict[str, Any] | None:
    """What a zygote is asked to run, or None where the command is not ``python`` running Python."""
    args = a["args"]
    if a["shell"] or isinstance(args, (str, bytes, os.PathLike)) or a["preexec_fn"] is not None or a["pass_fds"]:
        return None
    if a["start_new_session"] or a.get("process_group", -1) not in (-1, None) or a["umask"] != -1:
        return None
    if any(a[k] is not None for k in ("gid", "gids", "uid")) or not a["close_fds"]:
        return None
    args = [os.fspath(x) for x in args]
    if any(not isinstance(x, str) for x in args) or len(args) < 2:
        return None
    exe = os.fspath(a["executable"]) if a["executable"] is not None else args[0]
    if exe != sys.executable and os.path.realpath(exe) != os.path.realpath(sys.executable):
        return None
    if args[1] in ("-m", "-c"):
        if len(args) < 3:
            return None
        kind, what, rest = {"-m": "module", "-c": "code"}[args[1]], args[2], args[3:]
    elif args[1].startswith("-") or not args[1].endswith(".py"):
        return None
    else:
        kind, what, rest = "script", args[1], args[2:]
    env = dict(os.environ if a["env"] is None else a["env"])
    if any(not isinstance(k, str) or not isinstance(v, str) for k, v in env.items()):
        return None
    if env.get("TIERFS_TEST_SPAWN", "").strip() == "exec":  # a test that needs a fresh interpreter
        return None
    cwd = os.path.abspath(os.fspath(a["cwd"])) if a["cwd"] is not None else os.getcwd()
    if kind == "script":
        what = os.path.join(cwd, what)
    return {"kind": kind, "what": what, "args": rest, "env": env, "cwd": cwd}


class Popen(subprocess.Popen):  # type: ignore[type-arg]
    """``subprocess.Popen``, whose ``python`` commands a zygote forks (see the module docstring)."""

    def _execute_child(self, *args: Any, **kwargs: Any) -> None:
        a = dict(zip(_PARAMS, args)) | kwargs
        req = _request(a) if _state["on"] and not _state["broken"] else None
        if req is None:
            return super()._execute_child(*args, **kwargs)  # type: ignore[misc]
        p2cread, c2pwrite, errwrite = a["p2cread"], a["c2pwrite"], a["errwrite"]
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        try:
            pid = _next_zygote().spawn(req, fds)
        except OSError as e:
            _state["broken"] = f"{type(e).__name__}: {e}"
            warnings.warn(f"the test zygote is gone ({_state['broken']}); processes start with exec", stacklevel=2)
            return super()._execute_child(*args, **kwargs)  # type: ignore[misc]
        if pid <= 0:
            _state["broken"] = "the zygote could not fork"
            return super()._execute_child(*args, **kwargs)  # type: ignore[misc]
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(a["p2cread"], a["p2cwrite"], a["c2pread"], a["c2pwrite"], a["errread"], a["errwrite"])

"""A training loop's parts for bench_every_step.py: a small GPT with AdamW, the floor of a checkpoint every
step (a copy into RAM, a plain socket copy to the next rank, a plain upload every so often), and the
probes of background CPU and GIL.

Nothing in here is part of tierfs.
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from typing import Any

from _common import tensors
from fastcrc import crc32 as _crc32


def crc32c(data: Any) -> int:
    """crc32c of a buffer, with the library tierfs uses (fastcrc: the widest instructions, the GIL released)."""
    return int(_crc32.iscsi(data))


# -- the model ----------------------------------------------------------------------------------------
def gpt(vocab: int, d_model: int, layers: int, seq: int, seed: int) -> Any:
    """A decoder-only transformer in ``torch.nn`` parts (pre-norm encoder layers with a causal mask),
    untied LM head: the shape of a GPT, small enough for one CPU thread."""
    import torch
    from torch import nn

    torch.manual_seed(seed)

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.pos = nn.Parameter(torch.zeros(seq, d_model).normal_(std=0.02))
            layer = nn.TransformerEncoderLayer(d_model, max(1, d_model // 64), 4 * d_model, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

        def forward(self, tokens: Any) -> Any:
            x = self.embed(tokens) + self.pos
            return self.head(self.norm(self.blocks(x, mask=self.mask, is_causal=True)))

    return GPT()


class Trainer:
    """One rank's model, AdamW and batches; :meth:`step` is a training step, kept in lockstep with the
    other ranks by an all-reduce of the loss (as data-parallel and sharded jobs are; ``dist`` None: a
    process of its own, no all-reduce)."""

    def __init__(self, dist: Any, vocab: int, d_model: int, layers: int, seq: int, seed: int) -> None:
        import torch

        self.dist, self.vocab, self.seq = dist, vocab, seq
        self.model = gpt(vocab, d_model, layers, seq, seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(seed)
        self.batch = 1
        self.loss = torch.zeros(())

    def step(self) -> None:
        import torch
        import torch.nn.functional as F

        tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.gen)
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.opt.step()
        self.loss.copy_(loss.detach())
        if self.dist is not None:
            self.dist.all_reduce(self.loss)

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def calibrate(self, target: float, say: Any) -> float:
        """Pick the batch size whose step takes about ``target`` seconds on every rank (the slowest rank's
        estimate); returns the measured step time."""
        import statistics

        def timing(n: int = 4) -> float:
            self.step()
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                self.step()
                ts.append(time.perf_counter() - t0)
            out = [0.0] * self.dist.get_world_size()
            self.dist.all_gather_object(out, statistics.median(ts))
            return max(out)

        self.batch = 1
        for _ in range(3):  # the step is not quite linear in the batch: twice more, from the last estimate
            t = timing()
            self.batch = max(1, round(self.batch * target / t))
        t = timing()
        say(f"batch {self.batch} x {self.seq} tokens: {t:.3f} s per step (target {target} s)")
        return t


class DeviceLoop:
    """The host side of an accelerator's training step, on spare cores: each step runs ``launch`` of its
    time in pure Python (what a GPU job's training thread does while it launches kernels: it holds the
    GIL), then waits for the device for the rest (a sleep: the GIL is free, no core is used), then
    all-reduces the loss as :class:`Trainer` does. The checkpointed state is a :class:`Trainer`'s (a real
    GPT and its AdamW moments after one step), so the saves are of the same bytes and tensors; it does not
    change between steps, which changes nothing for a save. Each rank then uses a fraction of a core:
    what tierfs costs such a job is its time on the training thread and in the GIL, not the cores."""

    def __init__(self, dist: Any, vocab: int, d_model: int, layers: int, seq: int, seed: int,
                 launch: float = 0.15) -> None:
        import torch

        self.trainer = Trainer(dist, vocab, d_model, layers, seq, seed)
        self.trainer.step()  # AdamW's moments exist
        self.dist, self.launch, self.batch = dist, launch, 0
        self.loss = torch.zeros(())
        self.busy, self.idle = 0.0, 0.0

    def state(self) -> dict:
        return self.trainer.state()

    def step(self) -> None:
        end = time.perf_counter() + self.busy
        x = 0
        while time.perf_counter() < end:  # Python bytecode, the GIL held but for the interpreter's switches
            for i in range(100):
                x += i
        time.sleep(self.idle)
        self.dist.all_reduce(self.loss)

    def calibrate(self, target: float, say: Any) -> float:
        """``launch`` of ``target`` seconds in Python, the rest waiting; returns the measured step time."""
        import statistics

        self.busy, self.idle = self.launch * target, (1 - self.launch) * target
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            self.step()
            ts.append(time.perf_counter() - t0)
        out = [0.0] * self.dist.get_world_size()
        self.dist.all_gather_object(out, statistics.median(ts))
        say(f"device-shaped step: {self.busy * 1e3:.0f} ms in Python, {self.idle * 1e3:.0f} ms waiting: "
            f"{max(out):.3f} s per step (target {target} s)")
        return max(out)


def flat_views(state: dict, buf: Any) -> tuple[list[Any], list[Any]]:
    """The tensors of ``state`` (model and AdamW) and views of the same shapes into the uint8 tensor ``buf``."""
    srcs, dsts, off = [], [], 0
    for x in tensors(state):
        n = x.nelement() * x.element_size()
        dsts.append(buf[off:off + n].view(x.dtype).view(x.shape))
        srcs.append(x)
        off += n
    return srcs, dsts


def nbytes_of(state: dict) -> int:
    return sum(x.nelement() * x.element_size() for x in tensors(state))


# -- the floor: the same copies without tierfs ----------------------------------------------------------
class Floor:
    """A checkpoint every step with nothing but the copies: the state copied into a RAM buffer (one
    ``torch._foreach_copy_``, as tierfs stages), then on background threads at tierfs's CPU priority a
    plain socket ``sendall`` of those bytes to the next rank (whose thread ``recv_into``\\ s a buffer), and on
    every ``upload_every``-th step a plain s3fs upload of them. No checksums, commit, agreement or
    retention. Three buffers in turn, so a buffer being sent or uploaded is never overwritten; a step waits
    only when all three are (tierfs waits for room alike).

    ``verified``: what any checkpoint in RAM that outlives its process and is checked end to end must do
    on top, still without tierfs: the buffers and the receiver's are files on ``/dev/shm`` (mapped, as a
    RAM tier's are), the sender computes the crc32c of each buffer before it sends it and sends it after
    the bytes, and the receiver computes the crc32c of what it received and compares."""

    def __init__(self, dist: Any, state: dict, nice: int, upload: tuple[Any, str] | None, upload_every: int,
                 verified: bool = False) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.nbytes = nbytes_of(state)
        self.verified, self.mismatches, self._maps = verified, 0, []
        self.bufs = [self._buffer() for _ in range(3)]
        self.views = [flat_views(state, b) for b in self.bufs]
        self.inbox = self._buffer()
        self.busy = [0, 0, 0]
        self.cond = threading.Condition()
        self.nice, self.upload, self.upload_every = nice, upload, upload_every
        srv = socket.create_server(("127.0.0.1", 0))
        ports: list[Any] = [None] * world
        dist.all_gather_object(ports, srv.getsockname()[1])
        self.out = socket.create_connection(("127.0.0.1", ports[(rank + 1) % world]))
        self.conn, _ = srv.accept()
        srv.close()
        self.sends: list[Any] = []
        self.send_error: OSError | None = None  # why the sender stopped, if it did
        self.send_cond = threading.Condition()
        self.closed = False
        self.threads = [threading.Thread(target=self._sender, name="floor-send", daemon=True),
                        threading.Thread(target=self._receiver, name="floor-receive", daemon=True)]
        for t in self.threads:
            t.start()
        self.uploads: list[threading.Thread] = []

    def _buffer(self) -> Any:
        """A uint8 tensor of the state's size: anonymous memory, or (``verified``) a mapped file on /dev/shm."""
        import torch

        if not self.verified:
            return torch.zeros(self.nbytes, dtype=torch.uint8)
        import mmap
        import tempfile

        with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="floor-") as f:  # (unlinked: gone with the map)
            os.ftruncate(f.fileno(), self.nbytes)
            mm = mmap.mmap(f.fileno(), self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._maps.append(mm)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        buf.zero_()  # every page in place, as a RAM tier's pooled buffers are
        return buf

    def _free(self, i: int) -> None:
        with self.cond:
            self.busy[i] -= 1
            self.cond.notify_all()

    def save(self, step: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: 0 in self.busy)
            i = self.busy.index(0)
            self.busy[i] = 1
        srcs, dsts = self.views[i]
        import torch

        torch._foreach_copy_(dsts, srcs)
        if self.upload is not None and step % self.upload_every == 0:
            with self.cond:
                self.busy[i] += 1
            t = threading.Thread(target=self._upload, args=(i, step), daemon=True)
            t.start()
            self.uploads.append(t)
        with self.send_cond:
            self.sends.append(i)
            self.send_cond.notify_all()

    def _sender(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        while True:
            with self.send_cond:
                self.send_cond.wait_for(lambda: self.sends or self.closed)
                if not self.sends:
                    return
                i = self.sends[0]
            data = memoryview(self.bufs[i].numpy())
            if self.verified:  # the commit's checksum, then the bytes and it
                tail = crc32c(data).to_bytes(4, "little")
            try:
                self.out.sendall(data)
                if self.verified:
                    self.out.sendall(tail)
            except OSError as e:  # the peer went away: what waits for the sends raises, never hangs
                with self.send_cond:
                    self.send_error = self.send_error or e
                    self.sends.clear()
                    self.send_cond.notify_all()
                return
            with self.send_cond:
                self.sends.pop(0)
                self.send_cond.notify_all()
            self._free(i)

    def _receiver(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        mv = memoryview(self.inbox.numpy())
        tail = memoryview(bytearray(4 if self.verified else 0))
        while True:
            for view in (mv, tail):
                got = 0
                while got < len(view):
                    try:
                        n = self.conn.recv_into(view[got:], min(len(view) - got, 4 << 20))
                    except OSError:
                        return
                    if not n:
                        return
                    got += n
            if self.verified and crc32c(mv) != int.from_bytes(tail, "little"):
                self.mismatches += 1

    def _upload(self, i: int, step: int) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        try:
            fs, prefix = self.upload  # type: ignore[misc]
            fs.pipe_file(f"{prefix}/{step}.bin", self.bufs[i].numpy().tobytes())
        finally:
            self._free(i)

    def wait(self) -> None:
        with self.send_cond:
            self.send_cond.wait_for(lambda: not self.sends)
            if self.send_error is not None:
                raise RuntimeError(f"the floor's copy to the next rank failed: {self.send_error}")
        for t in self.uploads:
            t.join()
        self.uploads.clear()

    def close(self) -> None:
        self.wait()
        with self.send_cond:
            self.closed = True
            self.send_cond.notify_all()
        self.out.close()
        self.threads[0].join()
        self.conn.close()


# -- probes ---------------------------------------------------------------------------------------------
def cpu_of_process() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_of_children() -> float:
    """CPU seconds so far of this process's children: those running (tierfs's helper process), read from
    ``/proc``, and those that ended and were waited for."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = r.ru_utime + r.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    kids: set[str] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                kids.update(f.read().split())
        except OSError:
            continue
    for pid in kids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


def cpu_of_thread() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def cpu_by_thread(precise: bool = False) -> dict[str, float]:
    """CPU seconds so far of each live thread of this process, summed by role: Python threads by name
    (a trailing ``-N`` dropped, so ``tierfs-copy-peer``), the others by their OS name (``native
    gloo_tcp_loop``: gloo's I/O loop; ``native python``: torch's intra-op threads and the like). A thread
    that ended is in none (the caller finds it as the rest of the process's CPU). ``precise``: the time on
    a CPU from ``schedstat`` (nanoseconds), not user + system time in clock ticks."""
    import re

    names = {t.native_id: re.sub(r"-\d+$", "", t.name.split(" (")[0]) for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/{'schedstat' if precise else 'stat'}") as f:
                text = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # ended meanwhile
            continue
        if precise:
            seconds = int(text.split()[0]) / 1e9
        else:
            fields = text.rsplit(")", 1)[1].split()
            seconds = (int(fields[11]) + int(fields[12])) / tick
        role = names.get(int(tid)) or f"native {comm}"
        out[role] = out.get(role, 0.0) + seconds
    return out


def schedstat() -> tuple[float, float]:
    """The calling thread's seconds on a core and waiting for one (runnable), so far (Linux schedstat); the
    rest of its time it was blocked: on the GIL, a lock, a collective, I/O."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        run, wait, _ = f.read().split()
    return int(run) / 1e9, int(wait) / 1e9


class GilSampler:
    """Which thread holds this process's GIL, sampled ``rate`` times a second by py-spy (``py-spy record
    --gil --nonblocking``: it reads the interpreter's memory from outside, without stopping it, and at each
    sample records the thread that holds the GIL, if one does). Unlike :class:`GilProbe` it counts the GIL
    alone, never a wait for a core. ``start`` returns False (and the report says why) where py-spy is not
    installed or may not read this process."""

    def __init__(self, enabled: bool = True, rate: int = 250) -> None:
        import shutil
        import sys

        self.rate = rate
        here = os.path.join(os.path.dirname(sys.executable), "py-spy")
        self.exe = (here if os.access(here, os.X_OK) else shutil.which("py-spy")) if enabled else None
        self.why = "" if self.exe else "py-spy is not installed" if enabled else "not asked for: --gil-sampling"
        self._proc: Any = None
        self.cpu = 0.0  # CPU seconds py-spy itself took in its last sampling

    def start(self) -> bool:
        """Sample from now on (returns once py-spy sampled its first time), or say why not (False)."""
        import select
        import subprocess
        import tempfile

        if not self.exe:
            return False
        fd, out = tempfile.mkstemp(prefix="gil-sampler-", suffix=".txt")  # py-spy writes it; stop() removes it
        os.close(fd)
        self._proc = subprocess.Popen([self.exe, "record", "--gil", "--nonblocking", "--threads", "-r", str(self.rate),
                                       "-f", "raw", "-o", out, "-p", str(os.getpid())],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._out = out
        deadline, said = time.monotonic() + 30, b""
        while time.monotonic() < deadline and b"Sampling process" not in said:
            ready, _, _ = select.select([self._proc.stdout], [], [], 0.5)
            if ready:
                chunk = os.read(self._proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                said += chunk
        if b"Sampling process" not in said:
            self._stop()
            self.why = f"py-spy did not start: {said.decode(errors='replace').strip()[-300:] or 'no answer'}"
            self.exe = None
            return False
        return True

    def _stop(self) -> None:
        import signal

        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGINT)  # it writes its samples and ends
        try:
            _, _, usage = os.wait4(proc.pid, 0)
            self.cpu = usage.ru_utime + usage.ru_stime
        except ChildProcessError:
            self.cpu = 0.0
        proc.returncode = 0
        proc.stdout.close()

    def stop(self) -> dict[str, float]:
        """Seconds each thread role held the GIL since :meth:`start` (roles named as :func:`cpu_by_thread`
        names Python threads; ``MainThread`` is the training thread)."""
        import re

        self._stop()
        held: dict[str, float] = {}
        try:
            with open(self._out) as f:
                for line in f:
                    stack, _, count = line.rstrip().rpartition(" ")
                    head = stack.split(";", 1)[0]
                    name = head.split(": ", 1)[1] if ": " in head else head
                    role = re.sub(r"-\d+$", "", name.split(" (")[0])  # as cpu_by_thread names it
                    held[role] = held.get(role, 0.0) + int(count) / self.rate
        except (OSError, ValueError):
            pass
        finally:
            try:
                os.unlink(self._out)
            except OSError:
                pass
        return held


class GilProbe:
    """A thread that sleeps ``period`` seconds (``time.sleep`` lets go of the GIL) and records how late it
    gets the GIL back, ``1/period`` times a second. A wake-up that finds the GIL free is late by the OS's
    wake-up latency alone; one that finds it held waits until its holder lets go. So the share of wake-ups
    late by more than ``threshold`` beyond the median lateness of an uncontended loop estimates the share
    of time some other thread held the GIL (samples at regular times see each state for as long as it
    lasts); the training thread holds it too, so a variant's share minus the loop without checkpoints'
    is the background's. Waits for a core (not the GIL) count as well: an upper bound."""

    def __init__(self, period: float = 0.002) -> None:
        self.period = period
        self.late: list[float] = []
        self._stop = threading.Event()
        self.name = "gil-probe"  # (its CPU is not the background's)
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        sleep, clock, late, p = time.sleep, time.perf_counter, self.late, self.period
        while not self._stop.is_set():
            t0 = clock()
            sleep(p)
            late.append(clock() - t0 - p)

    def take(self) -> list[float]:
        out, self.late[:] = list(self.late), []
        return out

    def cpu(self) -> float:
        """The probe's own CPU seconds so far (Linux: from its thread's schedstat)."""
        with open(f"/proc/self/task/{self.native_id}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def held_share(late: list[float], base: float, threshold: float = 200e-6) -> float:
    """The share of the probe's wake-ups that waited more than ``threshold`` beyond ``base``."""
    return sum(1 for x in late if x - base > threshold) / max(1, len(late))


class FullCollections:
    """Python's full garbage collections (generation 2) while taken: each one's thread (the training
    thread or another) and seconds. A full collection walks every object of the process with the GIL
    held, so one on any thread stalls the training thread as long."""

    def __init__(self) -> None:
        import gc

        self._found: list[list[Any]] = []
        self._start = 0.0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self._found.append([threading.current_thread() is threading.main_thread(),
                                time.perf_counter() - self._start])

    def take(self) -> list[list[Any]]:
        """The collections since the last take: ``[on the training thread, seconds]`` each."""
        out, self._found = self._found, []
        return out

"""A checkpoint every step: what it costs a real training loop, against the same loop without
checkpoints and against the floor of the same copies without tierfs.

    .venv/bin/python benchmarks/bench_every_step.py [--step-times 0.2,1] [--steps 50] [--rounds 3] [--runs 3]

Starts ``--world`` processes (gloo on 127.0.0.1, each its own node with its own RAM directory; one torch
thread each, so the ranks fill the machine's cores as training fills a node's), and a moto S3 server in a
process of its own. Every rank trains a small GPT (``torch.nn`` transformer layers, untied head) with
AdamW on random tokens; each step ends with an all-reduce of the loss, so the ranks keep in lockstep as a
data-parallel or sharded job does. The batch is calibrated so a step takes about each of
``--step-times`` seconds. The checkpointed state is ``{"model": model.state_dict(), "optim":
optimizer.state_dict()}``: every parameter, both AdamW moments and the step counts.

Four variants take turns in ``--rounds`` rounds of ``--steps`` steps each (the order rotates every round,
so each sees the same moments of a shared machine):

- **no checkpoints**: the loop alone;
- **floor**: every step the state copied into a RAM buffer, then on background threads a plain socket copy
  of those bytes to the next rank and, every ``--upload-every``-th step, a plain s3fs upload of them: the
  copies a checkpoint every step needs, and nothing else (``_training.Floor``); the targets are counted
  from it;
- **verified floor**: the floor with what any checkpoint in RAM that outlives its process and is checked
  end to end must add, still without tierfs: its buffers (and the receiver's) are mapped files on
  ``/dev/shm``, the sender computes each buffer's crc32c before sending it and the receiver checks what
  it received against it (``Floor(verified=True)``). tierfs over this floor is what its own protocol
  costs (commit, agreement, manifests, retention) beyond those copies and checks;
- **tierfs**: ``TieredStore([MemoryTier(), PeerTier(replicas=1), ObjectTier(s3, save=
  FixedIntervalPolicy(50))])`` at its defaults (the background bandwidth cap included), ``save(step,
  state, blocking=False)`` every step; with ``--helper``, ``TieredStore(..., helper=True)`` (uploads from
  a process of each rank's own, whose CPU counts in the background's).

Both take the state's tensors once: the floor as views of its buffers, tierfs as the state dict built after
the warm-up (the model and AdamW update those tensors in place). Building the state dict again every step
costs the same to any checkpoint; it is timed apart and reported beside the figures.

A step's time is its whole wall time on the training thread: forward, backward, optimizer, the
all-reduce, and the save call. The floors are opened and warmed (three saves) before the timed rounds,
tierfs's store before each of its segments (three saves, untimed), and closed after it, as a loop
without checkpoints has no store: an open store's threads cost CPU while idle (each gloo group's I/O
loop wakes every 10 ms), which every variant's figures would otherwise share. After each round the
background work is waited for outside the timing, so no round's work spills into another variant's.

Reported per step time, medians over ranks and rounds (``--runs`` repeats, each a fresh job, and their
median): the slowdown of the mean step against the loop without checkpoints of the same round; p50 and
p99 step times (pooled over the rounds); the time in the save call; and, each beyond the loop without
checkpoints of the same round:

- the CPU time of every thread but the training one, per step (gloo's, tierfs's, the floor's; the
  probe's own excluded): what the background costs the machine;
- the share of time some other thread held the GIL, from a probe thread (``_training.GilProbe``: how
  late it gets the GIL back after a 2 ms sleep; a wait for a core counts too, so an upper bound);
- how long the background's threads and the training thread held the GIL, per step, from py-spy's
  samples of which thread holds it (``_training.GilSampler``: ``py-spy record --gil``, 250 samples a
  second from outside the process, which it does not stop; the GIL alone, never a wait for a core; its
  own CPU is reported and not counted as the background's), with ``--gil-sampling``. Where py-spy is
  missing or may not read the process (no ptrace permission) the report says so;
- the training thread's time waiting for a core (runnable, from its schedstat) and blocked (neither
  running nor runnable: on the GIL, or in the all-reduce for a slower rank): how the background slows
  the step, by taking cores or by holding the GIL.

``--loop device`` replaces the CPU training with the host side of an accelerator job on spare cores
(``_training.DeviceLoop``): each step spends ``--launch-share`` of its time in Python (launching work, the
GIL held) and the rest waiting for the device (the GIL free, no core used), on the same state. There the
background competes for no core, so what is left of the slowdown is the training thread's own time in
``save`` and its waits for the GIL: what a GPU job sees of tierfs.

``--only`` and ``--tiers`` run parts of it, to find what costs what. Raw output goes to
``benchmarks/results/bench_every_step-<day>-<k>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import MiB, launch_ranks, log, machine_note, results_path  # noqa: E402

VARIANTS = ("no checkpoints", "floor", "verified floor", "tierfs")
COLLECTIONS = None  # in each rank: its full garbage collections (_training.FullCollections)


# -- inside each rank -----------------------------------------------------------------------------------
def segment(trainer, n: int, first: int, save, wait, probe, sampler) -> dict:
    """``n`` timed steps numbered from ``first``, each followed by ``save(step)``; then ``wait()``
    (untimed). Returns the step times, the background CPU, the probe's samples and (``sampler``, where
    py-spy runs) the seconds per step each thread held the GIL."""
    import time

    from _training import cpu_by_thread, cpu_of_children, cpu_of_process, cpu_of_thread, schedstat

    sampling = sampler.start()
    trainer.dist.barrier()
    probe.take()
    COLLECTIONS.take()
    cpu0, own0, probe0, sched0, kids0 = cpu_of_process(), cpu_of_thread(), probe.cpu(), schedstat(), cpu_of_children()
    threads0 = cpu_by_thread()
    times, stalls = [], []
    for i in range(n):
        t0 = time.perf_counter()
        trainer.step()
        t1 = time.perf_counter()
        if save is not None:
            save(first + i)
        t2 = time.perf_counter()
        times.append(t2 - t0)
        stalls.append(t2 - t1)
    late = probe.take()
    full = COLLECTIONS.take()
    sched1 = schedstat()
    held = sampler.stop() if sampling else None
    on_cpu, queued = ((b - a) / n for a, b in zip(sched0, sched1))
    # tierfs's helper process (uploads), if any; not py-spy's own CPU
    helper = cpu_of_children() - kids0 - (sampler.cpu if sampling else 0.0)
    background = cpu_of_process() - cpu0 - (cpu_of_thread() - own0) - (probe.cpu() - probe0)
    # the background's CPU by thread role; what threads that ended took is the rest
    threads = {k: v - threads0.get(k, 0.0) for k, v in cpu_by_thread().items()
               if k not in ("MainThread", probe.name) and v - threads0.get(k, 0.0) > 0}
    threads["threads that ended"] = max(0.0, background - sum(threads.values()))
    if helper > 0:
        threads["helper process"] = helper
        background += helper
    if wait is not None:
        wait()
    # the training thread's time per step: on a core, waiting for one, and blocked (the GIL, the all-reduce)
    blocked = sum(times) / n - on_cpu - queued
    return {"times": times, "stalls": stalls, "background_cpu": background / n, "late": late,
            "main": [on_cpu, queued, blocked], "full_gc": full,
            "threads": {k: v / n for k, v in threads.items()},
            "gil_held": None if held is None else {k: v / n for k, v in held.items()},
            "sampler_cpu": sampler.cpu / n if sampling else 0.0}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from _common import Scratch, tensors
    from _training import DeviceLoop, Floor, FullCollections, GilProbe, GilSampler, Trainer, nbytes_of

    from tierfs import TieredStore
    from tierfs.policies import FixedIntervalPolicy, LatestN
    from tierfs.tiers import MemoryTier, ObjectTier, PeerTier
    from tierfs.util.worker import BACKGROUND_NICE

    global COLLECTIONS
    COLLECTIONS = FullCollections()
    torch.set_num_threads(1)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = log if rank == 0 else (lambda *a: None)  # noqa: E731
    logging.getLogger("tierfs").setLevel(logging.WARNING)
    import s3fs

    opts = {"endpoint_url": args.endpoint, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    scratch = Scratch(f"bench-every-step-{rank}-")
    probe = GilProbe()
    sampler = GilSampler(enabled=args.gil_sampling)
    out: dict = {"rank": rank, "targets": {}}
    if args.loop == "device":
        trainer = DeviceLoop(dist, args.vocab, args.d_model, args.layers, args.seq, seed=rank,
                             launch=args.launch_share)
    else:
        trainer = Trainer(dist, args.vocab, args.d_model, args.layers, args.seq, seed=rank)
    try:
        nbytes = None
        for target in args.step_times:
            measured = trainer.calibrate(target, say)
            state = trainer.state()
            nbytes = nbytes_of(state)
            ntensors = sum(1 for _ in tensors(state))
            say(f"state: {nbytes / MiB:.1f} MiB in {ntensors} tensors per rank; "
                f"{args.rounds} rounds x {len(VARIANTS)} variants x {args.steps} steps")
            tag = f"t{target}".replace(".", "_")

            def open_store(k: int):
                """A fresh store (its own RAM directory; the object tier's prefix is shared): its RAM tier
                and itself."""
                ram = MemoryTier(scratch.fresh(f"ram-{tag}-{k}"), keep=LatestN(2))
                tiers = {"ram": ram, "peer": PeerTier(replicas=1),
                         "s3": ObjectTier(f"s3://{args.bucket}/{tag}/tierfs", opts,
                                          save=FixedIntervalPolicy(args.upload_every), keep=LatestN(2))}
                return ram, TieredStore([tiers[t] for t in args.tiers.split(",")], helper=args.helper,
                                        **({"max_in_flight": args.max_in_flight} if args.max_in_flight else {}))

            opened = 0
            ram, store = open_store(opened)
            floor = Floor(dist, trainer.state(), BACKGROUND_NICE, (fs, f"{args.bucket}/{tag}/floor/{rank}"),
                          args.upload_every)
            verified = Floor(dist, trainer.state(), BACKGROUND_NICE, (fs, f"{args.bucket}/{tag}/verified/{rank}"),
                             args.upload_every, verified=True)
            step = 1
            try:
                for _ in range(3):  # warm: RAM buffers and replica buffers mapped, then reused; plans cached
                    trainer.step()
                    store.save(step, trainer.state(), blocking=False)
                    floor.save(step)
                    verified.save(step)
                    step += 1
                store.wait_until_finished()
                floor.wait()
                verified.wait()
                # tierfs's store is open during its own segments only: an open store's threads cost CPU while
                # idle (each gloo group's I/O loop wakes every 10 ms), which a loop without it does not spend
                store.close()
                scratch.remove(f"ram-{tag}-{opened}")
                store = None
                # the floor holds views of the state's tensors, made once; tierfs gets the state once too (the
                # model and AdamW update its tensors in place), and what building it costs is reported apart
                kept = trainer.state()
                state_ms = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    trainer.state()
                    state_ms.append((time.perf_counter() - t0) * 1e3)
                # steps numbered so that each segment begins at a multiple of --upload-every: every variant
                # uploads the same number of times
                res: dict = {v: [] for v in VARIANTS}
                buffers, held = {}, {}  # the RAM tier's buffers and where the steps are, after tierfs's last segment
                last = None  # the last step tierfs saved
                seg = 0
                for rnd in range(args.rounds):
                    order = VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)]
                    for v in order:
                        if args.only and v not in (args.only, "no checkpoints"):
                            continue
                        seg += 1
                        first = seg * args.upload_every * max(1, -(-args.steps // args.upload_every))
                        if v == "tierfs":
                            opened += 1
                            ram, store = open_store(opened)
                            for s in range(first - 3, first):  # warm, untimed: buffers mapped, plans cached
                                store.save(s, kept, blocking=False)
                            store.wait_until_finished()
                            r = segment(trainer, args.steps, first,
                                        lambda s: store.save(s, kept, blocking=False),
                                        store.wait_until_finished, probe, sampler)
                            buffers = {"ram": ram.stats()}
                            held = {str(k): sorted(v) for k, v in store.steps().items()}
                            store.close()
                            scratch.remove(f"ram-{tag}-{opened}")
                            store = None
                        elif v == "floor":
                            r = segment(trainer, args.steps, first, floor.save, floor.wait, probe, sampler)
                        elif v == "verified floor":
                            r = segment(trainer, args.steps, first, verified.save, verified.wait, probe, sampler)
                        else:
                            r = segment(trainer, args.steps, first, None, None, probe, sampler)
                        res[v].append(r)
                        if v == "tierfs":
                            last = first + args.steps - 1
                        say(f"  {target} s, round {rnd + 1}, {v}: median step "
                            f"{statistics.median(r['times']):.3f} s, mean {statistics.fmean(r['times']):.3f} s, in "
                            f"save {statistics.fmean(r['stalls']) * 1e3:.1f} ms, background CPU "
                            f"{r['background_cpu'] * 1e3:.1f} ms per step; training thread on a core / waiting "
                            f"for one / blocked: {' / '.join(f'{x * 1e3:.1f}' for x in r['main'])} ms per step")
                # every rank's floors done sending before any closes what it receives on (a rank that closed
                # it early would reset a slower neighbour's last copy)
                dist.barrier()
                say(f"RAM buffers: {buffers}")
                out["targets"][str(target)] = {"state_ms": statistics.median(state_ms), "buffers": buffers, "held": held, "last": last, "calibrated": measured, "batch": trainer.batch, "nbytes": nbytes,
                                               "tensors": ntensors, "rounds": res,
                                               "gil_sampling": sampler.why or "py-spy",
                                               "verified_floor_mismatches": verified.mismatches}
            finally:
                if store is not None:
                    store.close()
                    scratch.remove(f"ram-{tag}-{opened}")
                floor.close()
                verified.close()
    finally:
        probe.close()
        scratch.cleanup()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


# -- the report -----------------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def figures(run: list[dict], target: str) -> dict:
    """One run's figures for one step time: medians over ranks (and rounds) of each measure."""
    from _training import held_share

    per_rank = [r["targets"][target] for r in run]
    out: dict = {"batch": per_rank[0]["batch"], "nbytes": per_rank[0]["nbytes"], "tensors": per_rank[0]["tensors"],
                 "state_ms": statistics.median(pr.get("state_ms", 0.0) for pr in per_rank)}
    for v in VARIANTS:
        out[v] = {}
        if not per_rank[0]["rounds"][v]:
            continue
        slow, p50, p99, cpu, gil, stall, queued, blocked = [], [], [], [], [], [], [], []
        full: list[list] = []
        roles: dict[str, list[float]] = {}
        for pr in per_rank:
            rounds = pr["rounds"]
            base_late = statistics.median(x for s in rounds["no checkpoints"] for x in s["late"])
            for seg, none in zip(rounds[v], rounds["no checkpoints"]):
                slow.append(statistics.fmean(seg["times"]) / statistics.fmean(none["times"]) - 1)
                cpu.append(seg["background_cpu"] - none["background_cpu"])
                gil.append(held_share(seg["late"], base_late) - held_share(none["late"], base_late))
                stall.append(statistics.fmean(seg["stalls"]))
                queued.append(seg["main"][1] - none["main"][1])
                blocked.append(seg["main"][2] - none["main"][2])
                for k, x in seg.get("threads", {}).items():  # (beyond the loop without checkpoints)
                    roles.setdefault(k, []).append(x - none.get("threads", {}).get(k, 0.0))
            pooled = [t for s in rounds[v] for t in s["times"]]
            full.append([(len(pooled), g) for s in rounds[v] for g in s.get("full_gc", [])] or [(len(pooled), None)])
            p50.append(pct(pooled, 0.5))
            p99.append(pct(pooled, 0.99))
        held = gil_held(per_rank, v)
        out[v] = {**held, "slowdown": statistics.median(slow), "p50": statistics.median(p50), "p99": statistics.median(p99),
                  "cpu": statistics.median(cpu), "gil": statistics.median(gil), "stall": statistics.median(stall),
                  "queued": statistics.median(queued), "blocked": statistics.median(blocked),
                  **collections_of(full), "threads": {k: statistics.median(x) for k, x in roles.items()}}
    return out


def gil_held(per_rank: list[dict], v: str) -> dict:
    """Seconds per step the background's threads (all but the training one) and the training thread held
    the GIL by py-spy's samples, beyond the loop without checkpoints of the same round (medians over ranks
    and rounds), and by role; empty where no segment was sampled."""
    bg, main, sampler, segs = [], [], [], []
    for pr in per_rank:
        for seg, none in zip(pr["rounds"][v], pr["rounds"]["no checkpoints"]):
            if seg.get("gil_held") is None or none.get("gil_held") is None:
                continue
            others = {k: x for k, x in seg["gil_held"].items() if k not in ("MainThread", "gil-probe")}
            base = sum(x for k, x in none["gil_held"].items() if k not in ("MainThread", "gil-probe"))
            bg.append(sum(others.values()) - base)
            main.append(seg["gil_held"].get("MainThread", 0.0) - none["gil_held"].get("MainThread", 0.0))
            sampler.append(seg.get("sampler_cpu", 0.0))
            segs.append(others)
    roles = {k: [s.get(k, 0.0) for s in segs] for k in {k for s in segs for k in s}}  # absent: held 0 s
    if not bg:
        return {}
    return {"gil_bg": statistics.median(bg), "gil_main": statistics.median(main),
            "sampler_cpu": statistics.median(sampler),
            "gil_roles": {k: statistics.median(x) for k, x in roles.items()}}


def collections_of(per_rank: list[list]) -> dict:
    """Full collections per rank and 100 timed steps (the median over ranks), those on other threads than
    the training one, and their mean length in ms."""
    every, other, ms = [], [], []
    for found in per_rank:
        steps = found[0][0]
        got = [g for _, g in found if g is not None]
        every.append(100 * len(got) / steps)
        other.append(100 * sum(not main for main, _ in got) / steps)
        ms += [s * 1e3 for _, s in got]
    return {"gc": statistics.median(every), "gc_other": statistics.median(other),
            "gc_ms": statistics.fmean(ms) if ms else 0.0}


def report(runs: list[list[dict]], targets: list[str]) -> str:
    lines = []
    for target in targets:
        figs = [figures(run, target) for run in runs]
        f0 = figs[0]

        def med(v: str, k: str) -> float:
            return statistics.median(f[v][k] for f in figs)

        def every(v: str, k: str, fmt: str) -> str:
            return " ".join(format(f[v][k], fmt) for f in figs)

        step = med("no checkpoints", "p50")
        lines += [f"### A step of about {target} s (measured {step:.3f} s; "
                  f"{'batch ' + str(f0['batch']) if f0['batch'] else 'the device-shaped loop'}; "
                  f"{f0['nbytes'] / MiB:.1f} MiB in {f0['tensors']} tensors per rank)", "",
                  "| variant | slowdown | p50 step s | p99 step s | p99 / p99 without | in save, ms | background CPU, "
                  "ms per step | GIL held by others, share of time | training thread waiting for a core / blocked, ms "
                  "per step | slowdowns of the runs |", "|---|---|---|---|---|---|---|---|---|---|"]
        for v in VARIANTS:
            if not figs[0][v]:
                continue
            lines.append(
                f"| {v} | {med(v, 'slowdown') * 100:+.2f}% | {med(v, 'p50'):.3f} | {med(v, 'p99'):.3f} | "
                f"{med(v, 'p99') / med('no checkpoints', 'p99'):.3f} | {med(v, 'stall') * 1e3:.1f} | "
                f"{med(v, 'cpu') * 1e3:.1f} | {med(v, 'gil') * 100:+.2f}% | {med(v, 'queued') * 1e3:+.1f} / "
                f"{med(v, 'blocked') * 1e3:+.1f} | {every(v, 'slowdown', '+.4f')} |")
        lines.append("")
        sampled = [v for v in VARIANTS[1:] if f0[v] and "gil_bg" in f0[v]]
        if sampled:
            lines.append("- GIL held, from py-spy's samples (`record --gil`, 250 a second; it counts the GIL alone, not a "
                         "wait for a core), ms per step beyond the loop without checkpoints: by the background's "
                         "threads " + ", ".join(f"{v} {med(v, 'gil_bg') * 1e3:.2f}" for v in sampled)
                         + "; by the training thread " + ", ".join(f"{v} {med(v, 'gil_main') * 1e3:+.2f}" for v in sampled)
                         + f" (py-spy itself took {statistics.median(f[v]['sampler_cpu'] for f in figs for v in sampled) * 1e3:.1f}"
                         " ms of CPU per step)")
            roles = {k: statistics.median(f["tierfs"].get("gil_roles", {}).get(k, 0.0) for f in figs)
                     for k in f0["tierfs"].get("gil_roles", {})} if "tierfs" in sampled else {}
            shown = [f"{k} {x * 1e3:.2f}" for k, x in sorted(roles.items(), key=lambda kx: -kx[1]) if x * 1e3 >= 0.05]
            if "tierfs" in sampled:  # a short run's samples may catch none of them above 0.05 ms
                lines.append("- GIL held by tierfs's threads, ms per step: " + (", ".join(shown) or "each below 0.05"))
        else:
            why = runs[0][0]["targets"][target].get("gil_sampling", "not measured")
            lines.append(f"- GIL held (py-spy): not sampled ({why})")
        if not (f0["tierfs"] and f0["floor"]):
            lines.append("")
            continue
        lines += ["- full garbage collections in the timed steps, per rank and 100 steps (on other threads "
                      "than the training one; their mean ms): " + "; ".join(
                          f"{v} {med(v, 'gc'):.2f} ({med(v, 'gc_other'):.2f}; {med(v, 'gc_ms'):.0f} ms)"
                          for v in VARIANTS if f0[v])]
        for v in ("floor", "verified floor", "tierfs"):
            if not f0[v]:
                continue
            shares = {k: statistics.median(f[v]["threads"].get(k, 0.0) for f in figs) for k in f0[v].get("threads", {})}
            shown = [f"{k} {x * 1e3:.1f}" for k, x in sorted(shares.items(), key=lambda kx: -kx[1]) if x * 1e3 >= 0.5]
            if shown:
                lines.append(f"- background CPU by thread, {v}, ms per step beyond the loop without checkpoints: "
                             + ", ".join(shown))
        lines.append(f"- building the state (`model.state_dict()` and `optimizer.state_dict()`) takes "
                     f"{statistics.median(f['state_ms'] for f in figs):.2f} ms per call; the floor's views and "
                     "tierfs's state are made once (the tensors are updated in place), so a loop that builds the "
                     "state every step adds that to either")
        over = (med("tierfs", "slowdown") - med("floor", "slowdown")) * 100
        goal = 0.5 if float(target) >= 1 else 1.0
        p99 = med("tierfs", "p99") / med("no checkpoints", "p99")
        lines += ["", f"- tierfs over the floor: {over:+.2f} pp (target <= +{goal} pp: "
                      f"{'MET' if over <= goal else 'MISSED'}); p99 {p99:.3f}x the p99 without checkpoints "
                      f"(target <= 1.1x: {'MET' if p99 <= 1.1 else 'MISSED'})"]
        if f0["verified floor"]:
            checks = (med("verified floor", "slowdown") - med("floor", "slowdown")) * 100
            lines.append(f"- the verified floor over the floor: {checks:+.2f} pp (what checking every byte at both "
                         f"ends and keeping both copies on /dev/shm cost here); tierfs over the verified floor: "
                         f"{(med('tierfs', 'slowdown') - med('verified floor', 'slowdown')) * 100:+.2f} pp")
            bad = sum(pr["targets"][target].get("verified_floor_mismatches", 0) for run in runs for pr in run)
            if bad:
                lines.append(f"- WARNING: the verified floor's receivers found {bad} checksum mismatches")
        lines.append("")
    return "\n".join(lines)


def compact(runs: list) -> list:
    """The runs with each segment's probe samples replaced by their count and percentiles (ms)."""
    import copy

    out = copy.deepcopy(runs)
    for run in out:
        for r in run:
            for fig in r["targets"].values():
                for segs in fig["rounds"].values():
                    for seg in segs:
                        late = seg.pop("late")
                        seg["probe_late_ms"] = {"n": len(late), **{f"p{q}": round(pct(late, q / 100) * 1e3, 3)
                                                                    for q in (50, 90, 99)}} if late else {"n": 0}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-times", default="0.2,1", help="seconds per step to calibrate to, comma-separated")
    ap.add_argument("--steps", type=int, default=50, help="timed steps per variant and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1, help="fresh jobs; the report gives the median over them")
    ap.add_argument("--upload-every", type=int, default=50)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=None, help="results file (no extension); default benchmarks/results/...")
    ap.add_argument("--only", choices=VARIANTS[1:], help="run this variant alone beside the loop without "
                    "checkpoints (for profiling)")
    ap.add_argument("--tiers", default="ram,peer,s3", help="tierfs's tiers, for finding what costs what "
                    "(ram,peer,s3: the benchmark's setup)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval in every rank (Python's default: 0.005 s)")
    ap.add_argument("--loop", choices=("cpu", "device"), default="cpu",
                    help="cpu: the GPT trains on the CPU, one core per rank; device: an accelerator job's host "
                    "side on spare cores (Python launching work, then a wait for the device; _training.DeviceLoop)")
    ap.add_argument("--launch-share", type=float, default=0.15,
                    help="--loop device: the share of a step the training thread spends in Python")
    ap.add_argument("--max-in-flight", type=int, default=None,
                    help="TieredStore(max_in_flight=) for tierfs (default: the store's)")
    ap.add_argument("--helper", action="store_true", help="TieredStore(helper=True): tierfs uploads from a "
                    "process of each rank's own (its CPU counts in the background's)")
    ap.add_argument("--gil-sampling", action="store_true",
                    help="sample which thread holds the GIL with py-spy (_training.GilSampler; about 2%% of a "
                    "core per rank, in every variant alike)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--bucket", default="every-step", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.step_times = [float(x) for x in str(args.step_times).split(",")]
    if args.worker:
        worker(args)
        return 0
    from _scale import _MOTO, aws_env

    os.environ.update({k: v for k, v in aws_env().items() if k.startswith("AWS_")})
    moto = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=aws_env(), text=True)
    runs: list = []
    try:
        endpoint = f"http://127.0.0.1:{moto.stdout.readline().strip()}"
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=endpoint, key="testing",
                          secret="testing").mkdir(args.bucket)
        argv = [a for a in sys.argv[1:] if a != "--worker"]
        for k in range(args.runs):
            log(f"run {k + 1} of {args.runs}")
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                code = launch_ranks(__file__, [*argv, "--endpoint", endpoint, "--json", tmp.name], args.world)
                if code:
                    return code
                with open(tmp.name) as f:
                    runs.append(json.load(f))
    finally:
        moto.stdin.close()
        moto.wait()
    targets = [str(t) for t in args.step_times]
    loop = ("training a GPT on the CPU" if args.loop == "cpu" else
            f"the device-shaped loop ({args.launch_share:.0%} of a step in Python, the rest waiting)")
    text = (f"## bench_every_step: a checkpoint every step, {args.world} ranks, {loop}, {len(runs)} runs\n\n"
            + report(runs, targets) +
            f"- machine: {machine_note()}\n- command: `.venv/bin/python benchmarks/bench_every_step.py "
            f"{' '.join(sys.argv[1:])}`\n")
    print(text)
    out = args.out or results_path("bench_every_step")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write(text)
    with open(out + ".json", "w") as f:  # the probe's samples summed up: hundreds of thousands of them
        json.dump(compact(runs), f)
    log(f"wrote {out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

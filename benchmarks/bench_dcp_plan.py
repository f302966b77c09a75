"""DCP at scale: the coordinator's planning of a first save, and what it sends each rank.

    .venv/bin/python benchmarks/bench_dcp_plan.py [--worlds 8,64,512,1024,4096,8192] [--repeats 3]
        [--layouts dp,hsdp,fsdp] [--old-max-world 8192] [--run 1]

On the first save of a structure (and whenever DCP plans again), ``TieredWriter.prepare_global_plan`` on
the coordinator works out from the ranks' plans which items several ranks hold and who stores each
(``tierfs.adapters.dcp.sharing.plan_sharing``), and DCP scatters each rank's final plan, that sharing
included, back to it. This calls the planning directly on synthesized per-rank plans, no processes:

- the state: a GPT-like model's tensors (24 layers, hidden 2048: 292 tensors, fp32, about 1.3 G
  parameters), each a DCP write item;
- ``dp``: pure data parallelism, every rank holds every tensor whole;
- ``hsdp``: replica groups of 8 over shards (mesh ``[8, world / 8]``, rank = replica * shards + shard),
  each tensor split on dim 0 over the shards; at world 8 it is ``dp``;
- ``fsdp``: each rank its own chunk (dim 0 split over every rank): nothing is shared.

Sharded tensors' dim 0 is rounded up to a multiple of the shard count, so every rank holds 292 items
at every size. Each rank's local plan goes through DCP's own deduplication (``dedup_save_plans``, timed
as context), then the planning is timed: the code before this change (``old_plan_sharing`` below, a
copy of it) and the current one. The bytes are each rank's final plan as DCP's scatter sends it
(``pickle`` of the ``SavePlan`` with its ``storage_data``; DCP's ``scatter_object_list`` pads every
rank's message to the largest one, so the max is what every rank receives); ``tierfs part`` is the
pickle of the sharing alone. ``prepare_global_plan`` times the coordinator's whole step: tierfs's
metadata of the plans (unchanged) and the sharing, before (the collector on, as it ran) and now
(``TieredWriter.prepare_global_plan`` itself, which pauses the collector).

Results: a markdown table on stdout and in ``benchmarks/results/bench_dcp_plan-YYYYMMDD-<run>.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import pickle
import statistics
import sys
import time
import types
from typing import Any, Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import log, machine_note  # noqa: E402

import torch  # noqa: E402
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans  # noqa: E402
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties  # noqa: E402
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType  # noqa: E402

from tierfs.adapters.dcp.metadata import entry_name, metadata_from_plans, metadata_to_json  # noqa: E402
from tierfs.adapters.dcp.sharing import HELD, SHARED, held, plan_sharing, sharing_of  # noqa: E402
from tierfs.adapters.dcp.writer import TieredWriter  # noqa: E402


def old_plan_sharing(plans: Sequence[Any], ranks: Sequence[int], sid: str) -> list[dict[str, Any] | None]:
    """``plan_sharing`` as it was before this change (git 5deb19f), verbatim: O(items x N^2) for
    pure data parallelism, each rank's groups listed rank by rank."""
    names = [p.storage_data.get(HELD) if isinstance(p.storage_data, dict) else None for p in plans]
    if any(n is None for n in names):
        return [None] * len(plans)
    owner = {entry_name(i.index, i.type == WriteItemType.BYTE_IO): ranks[k] for k, p in enumerate(plans)
             for i in p.items}
    holders: dict[str, list[int]] = {}
    for k, ns in enumerate(names):
        for n in ns or ():
            holders.setdefault(n, []).append(ranks[k])
    out: list[dict[str, Any]] = [{"sid": sid, "groups": [], "owners": {}} for _ in plans]
    index: list[dict[tuple[int, ...], int]] = [{} for _ in plans]
    at = {r: k for k, r in enumerate(ranks)}
    for n, hs in holders.items():
        if len(hs) < 2 or n not in owner:
            continue
        group = tuple(sorted(hs))
        for r in group:
            k = at[r]
            gi = index[k].get(group)
            if gi is None:
                gi = index[k][group] = len(out[k]["groups"])
                out[k]["groups"].append(list(group))
            out[k]["owners"][n] = [owner[n], gi]
    return list(out)


def gpt_shapes(layers: int = 24, hidden: int = 2048, vocab: int = 50304, ctx: int = 2048
               ) -> list[tuple[str, tuple[int, ...]]]:
    """A GPT-2-like model's parameters (``nn.Linear`` weights as ``(out, in)``)."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.wte.weight", (vocab, hidden)), ("model.wpe.weight", (ctx, hidden))]
    for i in range(layers):
        p = f"model.h.{i}."
        out += [(p + "ln_1.weight", (hidden,)), (p + "ln_1.bias", (hidden,)),
                (p + "attn.c_attn.weight", (3 * hidden, hidden)), (p + "attn.c_attn.bias", (3 * hidden,)),
                (p + "attn.c_proj.weight", (hidden, hidden)), (p + "attn.c_proj.bias", (hidden,)),
                (p + "ln_2.weight", (hidden,)), (p + "ln_2.bias", (hidden,)),
                (p + "mlp.c_fc.weight", (4 * hidden, hidden)), (p + "mlp.c_fc.bias", (4 * hidden,)),
                (p + "mlp.c_proj.weight", (hidden, 4 * hidden)), (p + "mlp.c_proj.bias", (hidden,))]
    return out + [("model.ln_f.weight", (hidden,)), ("model.ln_f.bias", (hidden,))]


_PROPS = TensorProperties(dtype=torch.float32)


def _items(shapes: list[tuple[str, tuple[int, ...]]], shards: int, shard: int,
           cache: dict[tuple[str, int], WriteItem]) -> list[WriteItem]:
    """One rank's write items: chunk ``shard`` of ``shards`` on dim 0 of every tensor (dim 0 rounded up to a
    multiple of ``shards``); items of the same chunk are the same objects on every rank holding it."""
    out = []
    for fqn, shape in shapes:
        it = cache.get((fqn, shard))
        if it is None:
            d0 = -(-max(shape[0], shards) // shards) * shards
            size = torch.Size((d0, *shape[1:]))
            rows = d0 // shards
            offsets = torch.Size((shard * rows, *(0 for _ in shape[1:])))
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((rows, *shape[1:])))
            it = cache[(fqn, shard)] = WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                                 tensor_data=TensorWriteData(chunk=chunk, properties=_PROPS,
                                                                             size=size))
        out.append(it)
    return out


def local_plans(layout: str, world: int, shapes: list[tuple[str, tuple[int, ...]]]) -> list[SavePlan]:
    """Every rank's local plan as ``TieredWriter.prepare_local_plan`` makes it (its held names fresh
    strings per rank, as the coordinator unpickles them)."""
    shards = {"dp": 1, "hsdp": max(1, world // 8), "fsdp": world}[layout]
    cache: dict[tuple[str, int], WriteItem] = {}
    plans = []
    for r in range(world):
        items = _items(shapes, shards, r % shards, cache)
        plans.append(SavePlan(items, storage_data={"tierfs_rank": r, HELD: held(items)}))
    return plans


def old_prepare(plans: list[SavePlan]) -> list[SavePlan]:
    """The coordinator's ``TieredWriter.prepare_global_plan`` before this change: the metadata of the
    plans, then the old sharing, the collector on."""
    ranks = [p.storage_data["tierfs_rank"] for p in plans]
    metadata_to_json(metadata_from_plans(plans, ranks))
    shares = old_plan_sharing(plans, ranks, "0" * 32)
    return [dataclasses.replace(p, storage_data={"tierfs_rank": r, SHARED: sh}) for p, r, sh in zip(plans, ranks, shares)]


def new_prepare(plans: list[SavePlan]) -> list[SavePlan]:
    """``TieredWriter.prepare_global_plan`` as it is, on the coordinator of a job of ``len(plans)`` ranks."""
    w = object.__new__(TieredWriter)
    w.store = types.SimpleNamespace(group=types.SimpleNamespace(world_size=len(plans)))
    w.save_id, w.replicated = "0" * 32, "local"
    w._clear()
    return w.prepare_global_plan(plans)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def sent(final: list[SavePlan], shares: list[Any]) -> tuple[list[int], list[int]]:
    """Bytes of each rank's final plan as DCP scatters it (pickled), and of its sharing alone."""
    whole, part = [], []
    for r, (p, sh) in enumerate(zip(final, shares)):
        sd = {"tierfs_rank": r, SHARED: sh}
        whole.append(len(pickle.dumps(dataclasses.replace(p, storage_data=sd), protocol=pickle.HIGHEST_PROTOCOL)))
        part.append(len(pickle.dumps(sd, protocol=pickle.HIGHEST_PROTOCOL)))
    return whole, part


def planning(layout: str, world: int, repeats: int = 3) -> tuple[list[float], list[int]]:
    """The coordinator's sharing plan of a first save of a GPT-like state at ``world`` ranks, on synthesized
    per-rank plans: its timings (``repeats`` of them) and the bytes of each rank's final plan as DCP
    scatters it (``benchmarks/bench_scale.py`` prints them beside its per-rank counts)."""
    final = dedup_save_plans(local_plans(layout, world, gpt_shapes()))
    ranks = list(range(world))
    ts, shares = [], None
    for _ in range(repeats):
        t, shares = timed(lambda: plan_sharing(final, ranks, "sid"))
        ts.append(t)
    return ts, sent(final, shares)[0]


def kib(xs: list[int]) -> str:
    return f"{statistics.median(xs) / 1024:.1f} / {max(xs) / 1024:.1f}"


def secs(ts: list[float]) -> str:
    if not ts:
        return "-"
    m = statistics.median(ts)
    return f"{m * 1e3:.1f} ms" if m < 1 else f"{m:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="8,64,512,1024,4096,8192")
    ap.add_argument("--layouts", default="dp,hsdp,fsdp")
    ap.add_argument("--repeats", type=int, default=3, help="timings per variant (median)")
    ap.add_argument("--old-max-world", type=int, default=8192, help="time the old code up to this world size")
    ap.add_argument("--old-repeats", type=int, default=None, help="timings of the old code (default --repeats)")
    ap.add_argument("--whole-repeats", type=int, default=1,
                    help="timings of the whole prepare_global_plan (metadata included) per variant")
    ap.add_argument("--run", default="1", help="suffix of the results file")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    layouts = args.layouts.split(",")
    old_repeats = args.repeats if args.old_repeats is None else args.old_repeats
    shapes = gpt_shapes()
    rows = []
    for layout in layouts:
        for world in worlds:
            log(f"{layout} world {world}: synthesizing")
            plans = local_plans(layout, world, shapes)
            t_dedup, final = timed(lambda: dedup_save_plans(plans))
            ranks = list(range(world))
            new_t, old_t = [], []
            new = old = None
            for _ in range(args.repeats):
                t, new = timed(lambda: plan_sharing(final, ranks, "sid"))
                new_t.append(t)
            if world <= args.old_max_world:
                for _ in range(old_repeats):
                    log(f"{layout} world {world}: the old code")
                    t, old = timed(lambda: old_plan_sharing(final, ranks, "sid"))
                    old_t.append(t)
            if old is not None and [sharing_of(s) for s in old] != [sharing_of(s) for s in new]:
                raise SystemExit(f"{layout} world {world}: the sharing differs from the old code's")
            whole_new, whole_old = [], []
            for _ in range(args.whole_repeats):
                whole_new.append(timed(lambda: new_prepare(final))[0])
                if world <= args.old_max_world:
                    whole_old.append(timed(lambda: old_prepare(final))[0])
            new_b, new_part = sent(final, new)
            old_b, old_part = sent(final, old) if old is not None else ([0], [0])
            shared = sum(len(s["owners"]) for s in new if s is not None)
            rows.append([layout, world, secs(old_t), secs(new_t),
                         f"{statistics.median(old_t) / statistics.median(new_t):.0f}x" if old_t else "-",
                         kib(old_b) if old is not None else "-", kib(new_b),
                         kib(old_part) if old is not None else "-", kib(new_part),
                         secs(whole_old), secs(whole_new), secs([t_dedup]), shared])
            log(f"{layout} world {world}: old {secs(old_t)}, new {secs(new_t)}")
            del plans, final, new, old
    head = ["layout", "ranks", "planning, before", "planning, now", "speed-up",
            "plan sent per rank KiB, before (median / max)", "now (median / max)",
            "tierfs part KiB, before", "tierfs part KiB, now", "prepare_global_plan, before",
            "prepare_global_plan, now", "DCP's dedup (context)", "shared items (all ranks)"]
    lines = ["## DCP at scale: the coordinator's planning of a first save (`plan_sharing`)", "",
             f"- machine: {machine_note()}",
             f"- command: `.venv/bin/python benchmarks/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}`",
             f"- state: GPT-like, {len(shapes)} tensors per rank; planning: median of {args.repeats} "
             f"(before: {old_repeats}); prepare_global_plan: median of {args.whole_repeats}; bytes: pickled "
             "final SavePlan per rank as DCP scatters it (median / max)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       f"bench_dcp_plan-{time.strftime('%Y%m%d')}-{args.run}.md")
    with open(out, "w") as f:
        f.write(text)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()

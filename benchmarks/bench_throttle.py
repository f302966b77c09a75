"""How close a job training against a throttling object store comes to the time the store's rate allows.

    .venv/bin/python benchmarks/bench_throttle.py [--ranks 12] [--rate 2] [--steps 2] [--repeats 3]

Each run is ``tests/children/throttle_child.py``: RANKS ranks (gloo, each its own node) train a torch.nn
MLP with AdamW and save every step without blocking to RAM and to S3 (moto) through the tests' fault proxy,
which serves each key prefix ``rate`` requests per second (a burst of as many) and answers 503 SlowDown
beyond it. A run's time is the slowest rank's, from opening its store until every save is on the object
tier (its own listing and the restores that check the saves come after, and are not counted). The time
the bucket allows is the longer of two floors: its busiest prefix's (the requests it served then, less the
burst, at ``rate`` per second: no client could be done sooner) and the same job's time
through the proxy with no bucket (the job's own work). The ratio is the run's time over that; 1.0 would
be a client that never waits past the moment its prefix has a token. Median of the repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path[:0] = [HERE, TESTS]

import s3fs  # noqa: E402

import gloo_job  # noqa: E402
from _common import machine_note, results_path  # noqa: E402
from _faultproxy import FaultProxy, prefix_of  # noqa: E402
from _scale import _MOTO, aws_env  # noqa: E402

BUCKET = "tierfs-throttle"


def run(endpoint: str, ranks: int, rate: float | None, steps: int, k: int) -> dict:
    url = f"s3://{BUCKET}/run-{k}-{rate}-{int(time.time() * 1000) % 10**8}"
    with FaultProxy(endpoint) as proxy, tempfile.TemporaryDirectory(prefix="tierfs-thr-", dir="/dev/shm") as shm:
        proxy.set_bucket(rate, burst=rate)
        outs = gloo_job.run_job(ranks, os.path.join(TESTS, "children", "throttle_child.py"), shm, url, proxy.url,
                                endpoint, str(steps), "0", timeout=1800)
        t0, t1 = min(o["t0"] for o in outs), max(o["t1"] for o in outs)  # the timed part: the store's work

        def timed(r) -> bool:
            return t0 <= r.at <= t1
        served: dict[str, int] = {}
        for r in proxy.requests(fault=None, match=timed):
            served[prefix_of(r)] = served.get(prefix_of(r), 0) + 1
        refused = len(proxy.requests(fault="slowdown", match=timed))
    assert all(o["errors"] == [] and o["on_object"] == list(range(1, steps + 1)) for o in outs), outs
    assert all(all(o["exact"].values()) for o in outs), outs
    busiest = max(served, key=lambda p: served[p])
    floor = max(0.0, served[busiest] - rate) / rate if rate else 0.0
    took = max(o["elapsed"] for o in outs)
    refusals: dict[str, int] = {}
    for r in proxy.requests(fault="slowdown", match=timed):
        refusals[prefix_of(r)] = refusals.get(prefix_of(r), 0) + 1
    print(f"  busiest prefix {busiest.replace(url.removeprefix('s3://'), '<root>')!r}: {served[busiest]} served; "
          "most refused: " + ", ".join(f"{p.replace(url.removeprefix('s3://'), '<root>')!r} {n}" for p, n in
                                       sorted(refusals.items(), key=lambda kv: -kv[1])[:4]), flush=True)
    return {"took": took, "floor": floor, "prefixes": len(served), "busiest": served[busiest], "refused": refused,
            "requests": sum(served.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=12)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second per prefix")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    moto = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=aws_env(), text=True)
    try:
        endpoint = f"http://127.0.0.1:{moto.stdout.readline().strip()}"  # type: ignore[union-attr]
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=endpoint, key="testing", secret="testing").mkdir(BUCKET)
        rows = []
        for k in range(args.repeats):
            free = run(endpoint, args.ranks, None, args.steps, k)["took"]
            rows.append(run(endpoint, args.ranks, args.rate, args.steps, k) | {"free": free})
            rows[-1]["ratio"] = rows[-1]["took"] / max(rows[-1]["floor"], free)
            print(f"[{time.strftime('%H:%M:%S')}] run {k + 1}: {rows[-1]}", flush=True)
    finally:
        moto.stdin.close()  # type: ignore[union-attr]
        moto.wait(timeout=30)
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    lines = ["# bench_throttle: a job against a store that throttles each key prefix", "",
             f"- {time.strftime('%Y-%m-%d %H:%M:%S')}; {machine_note()}; load average at the end "
             f"{os.getloadavg()[0]:.1f}",
             f"- command: `.venv/bin/python benchmarks/bench_throttle.py --ranks {args.ranks} --rate {args.rate:g} "
             f"--steps {args.steps} --repeats {args.repeats}`", "",
             "| run | took s | no bucket s | the bucket's floor s | ratio | prefixes | requests | busiest prefix | "
             "refused (503) |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate([*rows, med]):
        name = str(i + 1) if i < len(rows) else "median"
        lines.append(f"| {name} | {r['took']:.1f} | {r['free']:.1f} | {r['floor']:.1f} | {r['ratio']:.2f} | {r['prefixes']:g} | "
                     f"{r['requests']:g} | {r['busiest']:g} | {r['refused']:g} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        path = results_path("bench_throttle") + ".md"
        with open(path, "w") as f:
            f.write(text)
        print(f"written: {path}")


if __name__ == "__main__":
    main()

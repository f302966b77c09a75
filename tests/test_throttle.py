"""The background bandwidth throttle, on a simulated clock (its sleeps advance the clock, nothing waits)."""

from __future__ import annotations

import random

import pytest

from tierfs.util.worker import THROTTLE_BURST, Throttle


class Clock:
    def __init__(self) -> None:
        self.now, self.slept = 1000.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def throttle(rate, burst):
    clock = Clock()
    return Throttle(rate, burst, clock=clock, sleep=clock.sleep), clock


def test_bursts_pass_then_every_caller_waits_until_back_on_the_rate():
    t, clock = throttle(100.0, 250)
    t.consume(100)
    t.consume(100)
    assert clock.slept == []  # 200 bytes ahead of the rate: within the burst
    t.consume(100)
    assert clock.slept == [pytest.approx(2.0)]  # would be 300 ahead: wait until the first 200 are due
    t.consume(100)
    assert clock.slept == [pytest.approx(2.0)]  # the next burst
    t.consume(100)
    assert clock.slept == [pytest.approx(2.0)] * 2


def test_zero_burst_paces_every_message():
    t, clock = throttle(100.0, 0)
    for _ in range(3):
        t.consume(50)
    assert clock.slept == [pytest.approx(0.5)] * 2  # each waits for the one before it


def test_idle_time_is_not_banked_beyond_the_burst():
    t, clock = throttle(100.0, 100)
    clock.now += 3600  # an hour idle
    t.consume(100)
    assert clock.slept == []
    t.consume(100)
    assert clock.slept == [pytest.approx(1.0)]


def test_a_message_larger_than_the_burst_waits_only_for_what_came_before_it():
    t, clock = throttle(100.0, 10)
    t.consume(1000)  # an idle throttle: at once
    assert clock.slept == []
    t.consume(1)
    assert clock.slept == [pytest.approx(10.0)]


@pytest.mark.parametrize("burst", [0, 1000, THROTTLE_BURST])
def test_never_ahead_of_rate_times_elapsed_plus_burst(burst):
    rng = random.Random(burst)
    rate, sizes = 1e6, [1, 4096, 1 << 20, 8 << 20]
    t, clock = throttle(rate, burst)
    start, passed = clock.now, 0
    for _ in range(2000):
        if rng.random() < 0.05:
            clock.now += rng.random() * 2  # idle between saves
            start, passed = clock.now, 0  # the bound holds from any busy period's start
        n = rng.choice(sizes)
        t.consume(n)
        passed += n
        assert passed <= rate * (clock.now - start) + max(burst, max(sizes)) + 1e-6 * rate
    # a long busy stream averages the rate: it cannot finish sooner than its bytes beyond the burst allow
    t, clock = throttle(rate, burst)
    start = clock.now
    for _ in range(100):
        t.consume(1 << 20)
    assert clock.now - start >= ((100 << 20) - burst - (1 << 20)) / rate - 1e-9


def test_callers_sharing_a_throttle_get_even_turns():
    """Two threads (an upload and a replication) pacing 8 MiB messages through one throttle, simulated in
    time order: each sends as soon as consume lets it, a message takes 1/10 of its paced time to send."""
    clock = Clock()
    slept: list[float] = []
    t = Throttle(256e6, THROTTLE_BURST, clock=clock, sleep=slept.append)
    ready, sent, msg = [clock.now, clock.now], [0, 0], 8 << 20
    for _ in range(400):
        who = min((0, 1), key=lambda i: (ready[i], sent[i]))
        clock.now = ready[who]
        slept.clear()
        t.consume(msg)
        ready[who] = clock.now + sum(slept) + msg / 256e6 / 10
        sent[who] += 1
    assert min(sent) >= 0.45 * sum(sent), sent
    # and together they keep the rate
    assert sum(sent) * msg <= 256e6 * (max(ready) - 1000.0) + THROTTLE_BURST + msg


def test_no_rate_never_waits():
    t, clock = throttle(None, 0)
    for _ in range(10):
        t.consume(1 << 30)
    assert clock.slept == []


@pytest.mark.parametrize("rate, burst", [(0, 1), (-5.0, 1), (1.0, -1)])
def test_bad_settings_are_refused(rate, burst):
    with pytest.raises(ValueError, match="throttle burst|background bandwidth"):
        Throttle(rate, burst)

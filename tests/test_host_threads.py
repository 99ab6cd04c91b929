"""The CPU wait is sampled for every compute thread of the process, not only the training thread:
a torch thread that shares its core with a busy process is seen even when the training thread,
waiting for it, never waits for a CPU itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from raytrain_fast.metrics.host import compute_thread_wait

pytestmark = pytest.mark.unit

_PLANTED = r"""
import hashlib, json, os, subprocess, sys, threading, time
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core for this process and its child
from raytrain_fast.metrics.host import HostSampler

def own_wait_s():
    with open("/proc/thread-self/schedstat") as stats:
        return int(stats.read().split()[1]) / 1e9

stop = threading.Event()
def compute():  # hashing releases the GIL, as torch's OpenMP threads compute without it
    data = os.urandom(1 << 20)
    while not stop.is_set():
        hashlib.sha256(data).digest()
threading.Thread(target=compute, daemon=True).start()
sampler = HostSampler(compute_threads=1)
busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # inherits the one-core affinity
try:
    time.sleep(0.5)
    sampler.window()
    before, started = own_wait_s(), time.perf_counter()
    time.sleep(1.5)  # the training thread waits for the compute thread, off the CPU
    window = sampler.window()
    own = (own_wait_s() - before) / (time.perf_counter() - started)
finally:
    busy.kill()
    stop.set()
print(json.dumps({"cpu_wait_frac": window.cpu_wait_frac, "training_thread_only": own}))
"""


def test_a_starved_torch_thread_is_seen_when_the_training_thread_is_not():
    done = subprocess.run([sys.executable, "-c", _PLANTED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    # The compute thread shares one core with a busy loop: it waits about half the time or more,
    # whatever the training thread's own wait (what the old sample read: near 0 on a quiet machine,
    # noisy on a loaded one, where the wake-ups of a sleeping thread wait too).
    assert measured["cpu_wait_frac"] > 0.3, measured
    assert measured["cpu_wait_frac"] >= measured["training_thread_only"] - 0.02, measured


def test_idle_threads_do_not_count_and_the_worst_compute_thread_does():
    before = {1: (0.0, 0.0), 2: (0.0, 0.0), 3: (0.0, 0.0), 5: (0.0, 0.0)}
    after = {
        1: (0.05, 0.01),  # the calling (training) thread: mostly waiting on the others
        2: (0.6, 0.4),  # a torch thread that waited 40% of the window for a core
        3: (0.01, 0.02),  # a thread that slept on a queue (a sink's wake-ups): not a compute thread
        5: (0.03, 0.3),  # a starved torch thread: hardly on a CPU, but runnable (and waiting) 33% of the time
        4: (5.0, 5.0),  # started during the window: no baseline
    }
    assert compute_thread_wait(before, after, elapsed=1.0, calling=1) == 0.4
    starved = {**after, 5: (0.03, 0.7)}
    assert compute_thread_wait({**before, 5: (0.0, 0.0)}, starved, elapsed=1.0, calling=1) == 0.7

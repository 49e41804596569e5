"""The thread tuner (minillm.core.threads) on made-up step times: all threads on a quiet machine,
even a noisy one; one thread soon after a neighbour arrives; all threads again once it leaves."""

from minillm.core.threads import ThreadTuner

QUIET = {2: 0.007, 1: 0.012}  # a decode step's seconds on 2 threads and on 1
NEIGHBOUR = {2: 0.200, 1: 0.020}  # beside a CPU-bound process: 2 threads wait on each other's slices


def run(tuner, times, steps, rows=1):
    """Take `steps` steps, each as long as times[threads]; the thread counts chosen."""
    chosen = []
    for _ in range(steps):
        threads = tuner.choose(rows)
        tuner.record(rows, threads, times[threads])
        chosen.append(threads)
    return chosen


def test_a_quiet_machine_never_probes_even_with_lone_slow_steps():
    tuner = ThreadTuner(2)
    assert run(tuner, QUIET, 50) == [2] * 50
    for _ in range(20):  # a noisy neighbour's hiccup: one step 3x slower now and then
        tuner.record(1, tuner.choose(1), 0.021)
        assert run(tuner, QUIET, 5) == [2] * 5


def test_a_burst_of_slow_steps_does_not_hand_over_to_one_thread():
    """Slow steps for a while on a quiet host (another tenant's burst) lift the all-thread average
    near one thread's time; a probe only slightly faster than it keeps all threads."""
    tuner = ThreadTuner(2)
    run(tuner, QUIET, 50)
    burst = {2: 0.030, 1: 0.017}  # two such steps lift the average to 18.7 ms: one thread only 1.1x faster
    chosen = run(tuner, burst, 3) + run(tuner, QUIET, 30)
    assert chosen[:3] == [2, 2, 1]  # the burst was probed
    assert chosen[3:] == [2] * 30


def test_a_neighbour_gets_one_thread_at_once_and_keeps_it_while_it_stays():
    tuner = ThreadTuner(2, probe_every=16, max_probe_every=64)
    run(tuner, QUIET, 20)
    chosen = run(tuner, NEIGHBOUR, 200)
    assert chosen[:2] == [2, 1]  # one slow step of two threads, then one thread
    probes = [i for i, c in enumerate(chosen) if c == 2 and i > 0]
    assert len(probes) <= 5  # all threads tried again now and then, less and less often
    assert all(b - a >= 16 for a, b in zip(probes, probes[1:]))


def test_all_threads_come_back_when_the_neighbour_leaves():
    tuner = ThreadTuner(2, probe_every=16, max_probe_every=64)
    run(tuner, QUIET, 20)
    run(tuner, NEIGHBOUR, 40)
    assert run(tuner, QUIET, 100)[-50:] == [2] * 50


def test_step_sizes_are_timed_apart():
    tuner = ThreadTuner(2)
    run(tuner, QUIET, 20, rows=1)
    run(tuner, {2: 0.5, 1: 0.9}, 20, rows=256)  # a prefill chunk is slower, not a neighbour
    assert run(tuner, {2: 0.5, 1: 0.9}, 5, rows=256) == [2] * 5


def test_one_thread_has_nothing_to_choose():
    assert run(ThreadTuner(1), NEIGHBOUR, 10) == [1] * 10

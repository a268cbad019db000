"""training/phases.py: a run's wall time split by phase, with XLA's compiling counted apart."""

import os
import time

import jax
import jax.numpy as jnp

from training.phases import COMPILE, PhaseClock, process_age_seconds


def test_nested_phases_and_compiling_are_each_counted_once():
    clock = PhaseClock()
    started = time.perf_counter()
    with clock.counting_compiles():
        with clock.phase("train"):
            time.sleep(0.05)
            with clock.phase("evaluation"):
                time.sleep(0.05)
                # A program never compiled before in this process: its tracing and compiling go to 'compile'.
                jax.jit(lambda x: jnp.sin(x) * 3.25 + x.sum())(jnp.arange(7.0)).block_until_ready()
            time.sleep(0.05)
    elapsed = time.perf_counter() - started
    seconds = dict(clock.seconds)
    assert set(seconds) == {"train", "evaluation", COMPILE}
    assert seconds[COMPILE] > 0
    assert seconds["train"] >= 0.1 and seconds["evaluation"] >= 0.05
    # Nothing counted twice: together they are within the block's wall time, and hold its three sleeps.
    assert 0.15 <= sum(seconds.values()) <= elapsed


def test_compiling_outside_counting_compiles_stays_in_its_phase():
    clock = PhaseClock()
    with clock.phase("setup"):
        jax.jit(lambda x: jnp.cos(x) - 1.5)(jnp.arange(5.0)).block_until_ready()
    assert set(clock.seconds) == {"setup", COMPILE} and clock.seconds[COMPILE] == 0


def test_the_process_age_includes_what_ran_before_this_test():
    age = process_age_seconds()
    # Its threads' CPU time fits in its age on all the cores; /proc counts in 10 ms ticks.
    assert age is not None and age >= time.process_time() / os.cpu_count() - 0.02

"""End to end: train, checkpoint, resume exactly, evaluate; and the command line."""

import json
import os
import time

import jax
import numpy as np
import pytest
from conftest import run_entry_point, tiny_config

from common.workdir import Workdir
from input_pipeline.tokenizer import load_tokenizer
from models.build import make_model
from training import loop
from training.checkpoints.checkpointer import Checkpointer
from training.optimizer import make_optimizer
from training.reporting import attempts
from training.runtime import sharding

pytestmark = pytest.mark.slow


def _restore(config, workdir, step):
    """The state and data position of `step`, the workdir's latest, restored as a resumed run restores them."""
    vocab_size = load_tokenizer(os.path.join(workdir, "tokenizer.model")).vocab_size()
    model = make_model(config, vocab_size)
    tx, _ = make_optimizer(config.optimizer, d_model=config.model.d_model)
    checkpointer = Checkpointer(workdir, read_only=True)
    state, position = loop.restore_latest_checkpoint(checkpointer, config, model, tx, sharding.make_mesh())
    checkpointer.close()
    assert int(state.step) == step
    return state, position


def _best(workdir):
    checkpointer = Checkpointer(workdir, read_only=True)
    best = checkpointer.best()
    checkpointer.close()
    return best


# The cheaper PRNG (config.prng_impl='rbg') checkpoints the same key and reruns a step bitwise
# (tests/test_step_options.py), so the loop's resume is tested once, with the default.
def test_resumed_training_equals_uninterrupted_training(small_corpus, tmp_path, compilation_cache):
    """Stopped at step 3 and resumed, against a run straight to step 6, both in this process.

    Not against the shared train.py run: under the tests' code generation (conftest's legacy fusion emitters) a
    step rounds differently in the last bit in this process than in a train.py process on some CPUs (an AMD EPYC
    with AVX-512), while two train.py processes agree and so do two runs in one process; with XLA's default
    emitters the train.py run and this process agree bitwise there too.
    """
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    loop.train_and_evaluate(tiny_config(small_corpus), straight)
    loop.train_and_evaluate(tiny_config(small_corpus, num_train_steps=3), resumed)
    loop.train_and_evaluate(tiny_config(small_corpus), resumed)

    config = tiny_config(small_corpus)
    state_a, data_a = _restore(config, straight, 6)
    state_b, data_b = _restore(config, resumed, 6)
    assert int(state_a.step) == int(state_b.step) == 6
    position = data_a["grain"]  # The chunk of records reached and the next pair in it: past the start.
    assert data_a == data_b and (position["parent"]["next_index"], position["offset"]) > (0, 0)
    jax.tree.map(np.testing.assert_array_equal, state_a.params, state_b.params)
    jax.tree.map(np.testing.assert_array_equal, state_a.opt_state, state_b.opt_state)
    with open(os.path.join(straight, "eval", "test", "scores.json")) as f:
        straight_scores = json.load(f)
    with open(os.path.join(resumed, "eval", "test", "scores.json")) as f:
        resumed_scores = json.load(f)
    assert straight_scores == resumed_scores
    # The best-BLEU checkpoint is chosen the same, across the restart.
    assert _best(straight) is not None and _best(straight) == _best(resumed)
    # Each attempt is a line of attempts.jsonl, with the step it reached.
    assert [attempt["step"] for attempt in attempts.read(Workdir(resumed).attempts)] == [3, 6]


def _run_cli(*args):
    return run_entry_point("train.py", *args)


def test_cli_trains_then_evaluates_a_checkpoint(small_corpus, tmp_path):
    """configs/tiny.py's model as it is: where `trained_tiny_run` was trained first in this test run, train.py
    reads its programs from the compilation cache instead of compiling its own."""
    workdir = str(tmp_path / "run")
    common = ["--config=configs/tiny.py", f"--workdir={workdir}", f"--config.dataset.path={small_corpus}"]
    started = time.monotonic()
    trained = _run_cli(*common, "--config.num_train_steps=4")
    trained_seconds = time.monotonic() - started
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "4"]
    assert os.path.exists(os.path.join(workdir, "tokenizer.model"))
    assert os.listdir(os.path.join(workdir, "tensorboard", "train"))
    # What ran it and where its time went: the phases and the compiling within the process's wall time.
    (attempt,) = attempts.read(Workdir(workdir).attempts)
    assert (attempt["step"], attempt["platform"], attempt["device_count"], attempt["dtype"]) == (4, "cpu", 1, "float32")
    assert attempt["commit"] and attempt["software"]["jax"] and attempt["cpu_kind"].startswith("cpu")
    seconds = attempt["seconds"]
    assert set(seconds) == {"setup", "compile", "train", "evaluation"} and min(seconds.values()) > 0
    assert sum(seconds.values()) < attempt["wall_seconds"] < trained_seconds + 0.02  # /proc counts in 10 ms ticks.

    evaluated = _run_cli(*common, "--mode=eval", "--checkpoint=3")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    out_dir = os.path.join(workdir, "eval", "test")
    with open(os.path.join(out_dir, "scores.json")) as f:
        scores = json.load(f)
    assert scores["step"] == 3 and scores["split"] == "test" and scores["checkpoint"] == "step 3"
    assert {"bleu", "signature", "loss", "perplexity"} <= set(scores)
    assert scores["signature"].startswith("nrefs:1|case:mixed")
    for name in ("hypotheses.txt", "references.txt"):
        with open(os.path.join(out_dir, name), encoding="utf-8") as f:
            assert len(f.read().splitlines()) == 40
    with open(os.path.join(small_corpus, "test.de"), encoding="utf-8") as f:
        references = f.read().splitlines()
    with open(os.path.join(out_dir, "references.txt"), encoding="utf-8") as f:
        assert f.read().splitlines() == references

    mismatched = _run_cli(*common, "--config.model.d_model=64", "--mode=eval")
    assert mismatched.returncode == 2
    last_line = mismatched.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: The checkpoint at step 4") and "does not fit the model" in last_line
    assert "Traceback" not in mismatched.stderr


def test_pmap_with_gradient_accumulation_trains_like_jit(small_corpus, tmp_path):
    """The loop's pmap path (state stacked per device, unstacked to checkpoint and evaluate) matches jit."""
    overrides = {"eval.num_bleu_sentences": 0, "eval.split": "valid", "model.dropout_rate": 0.0, "num_train_steps": 3}
    states = []
    for compilation in ("jit", "pmap"):
        workdir = str(tmp_path / compilation)
        config = tiny_config(small_corpus, step_compilation=compilation, grad_accumulation_steps=2, **overrides)
        loop.train_and_evaluate(config, workdir)
        states.append(_restore(config, workdir, 3)[0])
    jit_state, pmap_state = states
    assert int(pmap_state.step) == 3
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), pmap_state.params, jit_state.params
    )

"""Runs the train step, evaluation and checkpoint restore on 8 simulated CPU devices; run by test_multi_device.py.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
      python tests/multi_device_check.py layouts classifier positions decoding_cache checkpoint --directory=<empty dir>

`layouts` trains a small model for 5 steps on the same batches in every layout
(one device; pmap over 8; jit over 8 data, 4 data x 2 FSDP, 2 data x 4 tensor,
2 x 2 x 2; with gradient accumulation), prints the losses as a table, and checks
that they and the final parameters agree with the one-device run, that the state
keeps the shardings the rules give it, and that evaluation and greedy decoding on
the sharded parameters match the one-device results, also through evaluation's own
batching under rules that keep the batch off the FSDP axis. `checkpoint` saves under
8-way data parallelism and restores onto 4 data x 2 FSDP and 2 data x 4 tensor (the state, and
the average of two steps' parameters).
`classifier` trains the encoder classifier (config.task='classification') under pmap, tensor
parallelism and FSDP with micro-batches, and checks its losses and class probabilities against one device.
`positions` trains with relative positions (their tables, relative values and a
smaller key size) and with rotary positions on 2 data x 2 FSDP x 2 tensor, checking
losses, parameters and greedy decoding against one device. `decoding_cache` decodes on
4 data x 2 tensor and prints the cache bytes a device holds.
Each check prints `<check>: ok`, or its error and `<check>: FAILED`; the script exits 1 if any failed.
"""

import argparse
import sys
import traceback

import jax
import ml_collections
import numpy as np
from tolerances import loss_rtol  # This script's folder, tests/, is first on sys.path.

from common.special_ids import BOS_ID, EOS_ID
from configs import default
from input_pipeline.batching import ParallelIds, RaggedIds
from models.build import make_model
from models.continuous_batching import Block, Layout
from models.decoding import decode_batch
from models.search import SpecialIds
from models.token_search import TokenSearch, argmax_token
from training import loop
from training.checkpoints.checkpointer import Checkpointer
from training.optimizer import make_optimizer
from training.runtime import sharding
from training.state import initial_state, state_shardings
from training.steps import compile_train_step, eval_step
from training.tasks import classification, translation_decoding, translation_eval

NUM_STEPS = 5
PARAM_ATOL = 2e-5  # Adam's first steps move every weight by ~ the learning rate, 3e-3 here.

# name: (step compilation, data, fsdp, tensor, gradient accumulation steps, devices)
LAYOUTS = {
    "1 device": ("jit", 1, 1, 1, 1, 1),
    "pmap 8": ("pmap", 8, 1, 1, 1, 8),
    "jit 8 data": ("jit", 8, 1, 1, 1, 8),
    "jit 4 data x 2 fsdp": ("jit", 4, 2, 1, 1, 8),
    "jit 2 data x 4 tensor": ("jit", 2, 1, 4, 1, 8),
    "jit 2 data x 2 fsdp x 2 tensor": ("jit", 2, 2, 2, 1, 8),
    "jit 4 data x 2 fsdp, 2 micro-batches": ("jit", 4, 2, 1, 2, 8),
}


NUM_CLASSES = 6


def _config(data: int, fsdp: int, tensor: int, task: str = "translation", **model_fields) -> ml_collections.ConfigDict:
    config = default.get_config()
    config.task = task
    config.dataset.max_length = config.eval.max_decode_length = 16
    # Untied embeddings and learned positions: every kind of parameter is sharded.
    config.model.update(
        d_model=32,
        num_heads=4,
        d_ff=64,
        num_layers=1,
        norm_placement="pre",
        dropout_rate=0.0,
        tie_embeddings=False,
        positional_encoding="learned",
        dtype="float32",
    )
    config.model.update(model_fields)  # Overrides of the fields above.
    config.optimizer.update(schedule="rsqrt", peak_learning_rate=3e-3, warmup_steps=2)
    config.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
    return config


# Every layout computes the one-device losses in another order: within the rounding of 5 steps of them.
LOSS_RTOL = loss_rtol(make_model(_config(1, 1, 1), vocab_size=32).config, length=12, tokens=16 * 12, steps=NUM_STEPS)


def _batches(num_batches: int, batch_size: int = 16, length: int = 12, task: str = "translation"):
    """Random sentences of random lengths: devices hold different numbers of real tokens.

    Classification batches hold 'inputs' and 'labels' [batch_size], the last rows filler (all padding).
    """
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(num_batches):
        batch = {}
        for key in ("inputs", "targets") if task == "translation" else ("inputs",):
            ids = rng.integers(4, 32, (batch_size, length)).astype(np.int32)
            lengths = rng.integers(1, length + 1, batch_size)
            ids[np.arange(length)[None, :] >= lengths[:, None]] = 0
            batch[key] = ids
        if task == "classification":
            batch["inputs"][-3:] = 0
            batch["labels"] = rng.integers(0, NUM_CLASSES, batch_size).astype(np.int32)
        batches.append(batch)
    return batches


def _setup(data, fsdp, tensor, devices, task="translation", **model_fields):
    config = _config(data, fsdp, tensor, task, **model_fields)
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:devices])
    model = make_model(config, vocab_size=32, num_classes=NUM_CLASSES)
    tx, schedule = make_optimizer(config.optimizer, d_model=config.model.d_model)
    return config, mesh, model, tx, schedule


def _train(compilation, data, fsdp, tensor, micro_batches, devices, batches, task="translation", **model_fields):
    config, mesh, model, tx, schedule = _setup(data, fsdp, tensor, devices, task, **model_fields)
    shardings = state_shardings(config, model, tx, mesh)
    state = initial_state(config, model, tx, shardings)
    train_step = compile_train_step(
        compilation,
        mesh,
        config.mesh.rules,
        shardings,
        loss_fn=loop.make_task(config).loss_fn(config, model),
        tx=tx,
        learning_rate_fn=schedule,
        grad_accumulation_steps=micro_batches,
    )
    step_state, losses = train_step.enter(state), []
    for i, batch in enumerate(batches):
        step_state, metrics = train_step.run(step_state, train_step.place_batch(batch), jax.random.PRNGKey(i))
        losses.append(float(metrics["loss"]))
    state = train_step.leave(step_state)
    if compilation == "jit":  # The state keeps the layout the rules give it.
        jax.tree.map(lambda a, s: _assert(a.sharding.is_equivalent_to(s, a.ndim), (a.sharding, s)), state, shardings)
    return losses, state, (config, mesh, model)


def _assert(condition, message):
    if not condition:
        raise AssertionError(message)


def _evaluate(params, mesh, model, batch):
    """Eval sums and greedy translations on `mesh`, with `params` sharded as they are."""
    sums = jax.jit(lambda p, b: eval_step(p, b, model=model))(params, sharding.shard_batch(batch, mesh))
    return jax.device_get(sums), _greedy_tokens(params, mesh, model, batch)


def _greedy_tokens(params, mesh, model, batch) -> np.ndarray:
    """Greedy translations of `batch`'s inputs on `mesh`, with `params` sharded as they are."""
    greedy = TokenSearch(argmax_token, SpecialIds(bos=BOS_ID, eos=EOS_ID, pad=0))
    decode = jax.jit(lambda p, x: greedy.best(decode_batch(greedy, model, p, x, max_length=10)))
    return np.asarray(decode(params, sharding.shard_batch(batch, mesh)["inputs"]))


def check_layouts() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    batches = _batches(NUM_STEPS)
    results = {name: _train(*layout, batches) for name, layout in LAYOUTS.items()}
    reference_losses, reference_state, _ = results["1 device"]
    reference_params = jax.device_get(reference_state.params)

    print(
        f"{'layout':<38}"
        + "".join(f"{f'step {i + 1}':>11}" for i in range(NUM_STEPS))
        + "  max rel diff  max param diff"
    )
    failures = []
    for name, (losses, state, _) in results.items():
        loss_diff = float(np.max(np.abs(np.asarray(losses) / reference_losses - 1)))
        params = jax.device_get(state.params)
        param_diff = max(
            jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, reference_params))
        )
        print(
            f"{name:<38}" + "".join(f"{loss:>11.6f}" for loss in losses) + f"  {loss_diff:>12.1e}  {param_diff:>14.1e}"
        )
        if loss_diff > LOSS_RTOL or param_diff > PARAM_ATOL:
            failures.append(name)
    _assert(not failures, f"differ from one device beyond rtol {LOSS_RTOL} / atol {PARAM_ATOL}: {failures}")

    # Evaluation and decoding on parameters sharded over all three axes: the same
    # sums and translations as on one device (the parameters agree up to rounding).
    _, state, (_, mesh, model) = results["jit 2 data x 2 fsdp x 2 tensor"]
    query = state.params["encoder"]["layers_0"]["self_attention"]["query"]["kernel"]  # [d_model, heads, head_dim]
    _assert(query.sharding.shard_shape(query.shape) == (16, 2, 8), query.sharding)
    sums, tokens = _evaluate(state.params, mesh, model, batches[0])
    _, _, (_, mesh, model) = results["1 device"]
    reference_sums, reference_tokens = _evaluate(reference_state.params, mesh, model, batches[0])
    for key in ("nll", "correct", "tokens"):
        _assert(np.isclose(sums[key], reference_sums[key], rtol=LOSS_RTOL), (key, sums, reference_sums))
    _assert(np.array_equal(tokens, reference_tokens), ("greedy decoding differs", tokens, reference_tokens))

    # Evaluation's batching sizes and places its batches by config.mesh.rules: with the batch on
    # 'data' only (4 shards), a 12-row batch, which 4 data x 2 FSDP placed by the default rules
    # (8 shards) could not split.
    _, state, (config, mesh, model) = results["jit 4 data x 2 fsdp"]
    config.mesh.rules = (("batch", "data"), *(rule for rule in config.mesh.rules if rule[0] != "batch"))
    config.eval.per_device_batch_size = 3
    pairs = ParallelIds(
        *(RaggedIds.from_lists([row[row != 0] for row in batches[0][key]]) for key in ("inputs", "targets"))
    )
    metrics, translations, batch_sizes = _evaluate_split(state.params, config, mesh, model, pairs)
    _assert(batch_sizes[16] == 12, batch_sizes)
    # Beam search in rows split over the mesh (models/continuous_batching.py), sentences moving on to shorter stages.
    beam_config = config.copy_and_resolve_references()
    beam_config.eval.beam_size, beam_config.eval.per_device_batch_size = 2, 6
    beams = _translate_split(state.params, beam_config, mesh, model, pairs)
    _, _, (config, mesh, model) = results["1 device"]
    reference_metrics, reference_translations, _ = _evaluate_split(reference_state.params, config, mesh, model, pairs)
    _assert(np.isclose(metrics["loss"], reference_metrics["loss"], rtol=LOSS_RTOL), (metrics, reference_metrics))
    _assert(translations == reference_translations, ("translations differ", translations, reference_translations))
    beam_config.mesh.rules = config.mesh.rules
    reference_beams = _translate_split(reference_state.params, beam_config, mesh, model, pairs)
    _assert(beams == reference_beams, ("beam search differs", beams, reference_beams))
    print("layouts: ok")


def _evaluate_split(params, config, mesh, model, pairs: ParallelIds):
    """Loss metrics, translations and batch sizes of `pairs` through evaluation's batching, rows and placement."""
    setup = translation_eval.eval_setup(config, model, None, mesh)
    metrics = translation_eval.loss_metrics(setup, params, pairs)
    translations = translation_decoding.translate_ids(setup.translator, params, pairs.sources)
    return metrics, translations, setup.translator.rows


def _translate_split(params, config, mesh, model, pairs: ParallelIds) -> list[list[int]]:
    """Translations of `pairs` through evaluation's decoding alone: what the beam search checks compare."""
    translator = translation_decoding.translator(config, model, None, mesh)
    return translation_decoding.translate_ids(translator, params, pairs.sources)


def check_classifier() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    batches = _batches(NUM_STEPS, task="classification")
    # FSDP with the classifier's loss on the micro-batch layout alone: its parameters are laid out as without
    # micro-batches, and sharding the parameters is the same for any loss (`check_layouts` checks both).
    names = ["1 device", "pmap 8", "jit 2 data x 4 tensor", "jit 4 data x 2 fsdp, 2 micro-batches"]
    results = {name: _train(*LAYOUTS[name], batches, task="classification") for name in names}
    reference_losses, reference_state, (config, mesh, model) = results["1 device"]
    reference = classification.predict_probabilities(
        classification.PredictSetup(classification.make_predict_fn(model), mesh, (12,), {12: 16}, config.mesh.rules),
        reference_state.params,
        RaggedIds.from_lists([row[row != 0] for row in batches[0]["inputs"][:-3]]),
    )
    for name, (losses, state, (config, mesh, model)) in results.items():
        loss_diff = float(np.max(np.abs(np.asarray(losses) / reference_losses - 1)))
        print(f"classifier, {name:<38}" + "".join(f"{loss:>11.6f}" for loss in losses) + f"  {loss_diff:>9.1e}")
        _assert(loss_diff <= LOSS_RTOL, (name, losses, reference_losses))
        if name.startswith("jit"):  # Predictions on the sharded parameters (batches split over the mesh).
            setup = classification.PredictSetup(
                classification.make_predict_fn(model), mesh, (12,), {12: 16}, config.mesh.rules
            )
            sources = RaggedIds.from_lists([row[row != 0] for row in batches[0]["inputs"][:-3]])
            probabilities = classification.predict_probabilities(setup, state.params, sources)
            _assert(np.allclose(probabilities, reference, atol=1e-5), (name, probabilities, reference))
    head = results["jit 2 data x 4 tensor"][1].params["head"]["kernel"]
    _assert(head.sharding.shard_shape(head.shape) == head.shape, head.sharding)  # 'classes': replicated.
    print("classifier: ok")


def check_positions() -> None:
    """Relative and rotary positions: their parameters shard (or replicate) and train as on one device."""
    assert len(jax.devices()) == 8, jax.devices()
    batches = _batches(NUM_STEPS)
    kinds = {
        "relative": dict(positional_encoding="relative", relative_clip=3, relative_values=True, key_dim=4),
        "rotary": dict(positional_encoding="rotary"),
    }
    names = ["1 device", "jit 2 data x 2 fsdp x 2 tensor"]
    for kind, model_fields in kinds.items():
        results = {name: _train(*LAYOUTS[name], batches, **model_fields) for name in names}
        reference_losses, reference_state, (config, mesh, model) = results["1 device"]
        reference_params = jax.device_get(reference_state.params)
        reference_tokens = _greedy_tokens(reference_state.params, mesh, model, batches[0])
        for name, (losses, state, (config, mesh, model)) in results.items():
            loss_diff = float(np.max(np.abs(np.asarray(losses) / reference_losses - 1)))
            param_diff = max(
                jax.tree.leaves(
                    jax.tree.map(
                        lambda a, b: float(np.max(np.abs(a - b))), jax.device_get(state.params), reference_params
                    )
                )
            )
            print(f"{kind}, {name:<38}" + "".join(f"{loss:>11.6f}" for loss in losses) + f"  {loss_diff:>9.1e}")
            _assert(loss_diff <= LOSS_RTOL and param_diff <= PARAM_ATOL, (kind, name, loss_diff, param_diff))
            if name != "1 device":  # The reference's own translations are what the sharded ones must equal.
                tokens = _greedy_tokens(state.params, mesh, model, batches[0])
                _assert(np.array_equal(tokens, reference_tokens), (kind, name, "greedy decoding differs"))
        if kind == "relative":  # The tables [2 * clip + 1, d_k or d_v] are replicated ('kv' maps to None).
            attention = results[names[-1]][1].params["encoder"]["layers_0"]["self_attention"]
            for table in attention["relative_positions"].values():
                _assert(table.sharding.shard_shape(table.shape) == table.shape, table.sharding)
            query = attention["query"]["kernel"]  # [d_model, heads, d_k]: d_model over 'fsdp', heads over 'tensor'.
            _assert(query.sharding.shard_shape(query.shape) == (16, 2, 4), query.sharding)
    print("positions: ok")


def _abstract(array: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding)


def check_checkpoint(directory: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    batches = _batches(2)
    _, first_state, _ = _train("jit", 8, 1, 1, 1, 8, batches[:1])
    _, saved_state, _ = _train("jit", 8, 1, 1, 1, 8, batches)
    checkpointer = Checkpointer(directory)
    checkpointer.save(first_state, {"epoch": 0, "batch": 1})
    checkpointer.save(saved_state, {"epoch": 0, "batch": 2})
    checkpointer.wait_until_finished()
    saved_params = jax.device_get(saved_state.params)
    first_params = jax.device_get(first_state.params)
    for data, fsdp, tensor in ((4, 2, 1), (2, 1, 4)):
        config, mesh, model, tx, _ = _setup(data, fsdp, tensor, 8)
        restored, data_state = loop.restore_latest_checkpoint(checkpointer, config, model, tx, mesh)  # Step 2.
        expected = state_shardings(config, model, tx, mesh)
        _assert(data_state == {"epoch": 0, "batch": 2}, data_state)
        jax.tree.map(lambda a, s: _assert(a.sharding == s, (a.sharding, s)), restored, expected)
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), saved_params)
        jax.tree.map(
            np.testing.assert_array_equal, jax.device_get(restored.opt_state), jax.device_get(saved_state.opt_state)
        )
        # The average of steps 1 and 2, read onto this mesh: shard by shard, the numpy mean of the saved steps.
        averaged = checkpointer.average_params((1, 2), jax.tree.map(_abstract, restored.params))
        jax.tree.map(
            lambda a, s: _assert(a.sharding == s.sharding, (a.sharding, s.sharding)), averaged, restored.params
        )
        mean = jax.tree.map(lambda a, b: ((a + b) / np.float32(2)).astype(a.dtype), first_params, saved_params)
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(averaged), mean)
        kernel = restored.params["decoder"]["layers_0"]["feed_forward"]["hidden"]["kernel"]
        shard = kernel.sharding.shard_shape(kernel.shape)
        print(
            f"restored onto data={data} fsdp={fsdp} tensor={tensor}: feed-forward kernel {kernel.shape}, shards {shard}"
        )
    checkpointer.close()
    print("checkpoint: ok")


def check_decoding_cache() -> None:
    """Decoding on 4 data x 2 tensor: rows split over data, the attention caches over the heads too (as the
    attention's parameters are), so that a device holds an eighth of every cache; the same translations as
    on one device."""
    assert len(jax.devices()) == 8, jax.devices()
    config, mesh, model, tx, _ = _setup(4, 1, 2, 8)
    params = initial_state(config, model, tx, state_shardings(config, model, tx, mesh)).params
    rows, source_length, max_length = 8, 16, 40
    rng = np.random.default_rng(1)
    sources = [list(rng.integers(4, 32, rng.integers(1, 12))) + [EOS_ID] for _ in range(rows)]
    translator = translation_decoding.translator(config, model, None, mesh)
    block = Block(
        np.zeros((rows, source_length), np.int32), np.full(rows, 20, np.int32), np.arange(rows, dtype=np.int32)
    )
    for row, ids in enumerate(sources):
        block.inputs[row, : len(ids)] = ids
    rows_sharding = sharding.without_unit_axes(sharding.batch_sharding(mesh, config.mesh.rules))
    held = {}
    for name, cache_sharding in (
        ("heads split", sharding.without_unit_axes(sharding.decoding_cache_sharding(mesh, config.mesh.rules))),
        ("rows only", rows_sharding),
    ):
        layout = Layout(rows_sharding, cache_sharding)

        def place(tree, heads=False, layout=layout):  # As translation_decoding.translate_ids places them.
            return translation_decoding.place_rows(tree, layout.heads if heads else layout.rows)

        decoding = translator.decoder.empty(params, rows, source_length, max_length, place)
        decoding, _ = translator.decoder.advance(params, decoding, place(block), rows, layout=layout)
        # The same program again: the decoding comes back laid out as it went in.
        decoding, _ = translator.decoder.advance(params, decoding, place(block), rows, layout=layout)
        _assert(translator.decoder.advance._cache_size() == (1 if name == "heads split" else 2), name)
        caches = jax.tree.leaves((decoding.cache, decoding.context["cross"]))
        held[name] = (
            sum(leaf.addressable_shards[0].data.nbytes for leaf in caches),
            sum(leaf.nbytes for leaf in caches),
        )
    print(
        f"decoding_cache: a device holds {held['heads split'][0]} of {held['heads split'][1]} cache bytes with "
        f"the heads split, {held['rows only'][0]} with the rows split only"
    )
    _assert(held["heads split"][0] * 8 == held["heads split"][1], held)
    _assert(held["rows only"][0] * 4 == held["rows only"][1], held)
    one_config, one_mesh, _, _, _ = _setup(1, 1, 1, 1)
    one_params = jax.device_put(params, jax.sharding.NamedSharding(one_mesh, jax.sharding.PartitionSpec()))
    one_device = translation_decoding.translator(one_config, model, None, one_mesh)
    ragged = RaggedIds.from_lists(sources)
    translations = translation_decoding.translate_ids(translator, params, ragged)
    _assert(translations == translation_decoding.translate_ids(one_device, one_params, ragged), translations)
    print("decoding_cache: ok")


CHECKS = {
    "layouts": check_layouts,
    "classifier": check_classifier,
    "positions": check_positions,
    "decoding_cache": check_decoding_cache,
}


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "checks",
        nargs="+",
        choices=[*CHECKS, "checkpoint"],
        help="layouts: every layout's losses, parameters, evaluation and decoding against one device; classifier: "
        "the encoder classifier in the layouts; positions: relative and rotary positions on 2 x 2 x 2; "
        "decoding_cache: the cache bytes a device holds on 4 data x 2 tensor; "
        "checkpoint: save on 8-way data, restore onto other meshes (in --directory)",
    )
    parser.add_argument("--directory", help="checkpoint: an empty directory to save into")
    arguments = parser.parse_args()
    if "checkpoint" in arguments.checks and not arguments.directory:
        parser.error("checkpoint needs --directory")
    return arguments


def main() -> int:
    """Runs each check asked for in this one process (JAX starts once; a program compiled by one check is in
    the compilation cache for the next); a failed check prints its error and the next still runs."""
    arguments = _arguments()
    failed = []
    for name in arguments.checks:
        try:
            if name == "checkpoint":
                check_checkpoint(arguments.directory)
            else:
                CHECKS[name]()
        except Exception:  # pylint: disable=broad-except
            traceback.print_exc()
            print(f"{name}: FAILED")
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

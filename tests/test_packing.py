"""Packed rows (several pairs a row, with segment ids and positions): each pair as if it had a row of its own."""

import dataclasses
import functools
import re

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL
from tolerances import loss_rtol, rounding_tolerance, transformer_operations

from configs import default
from models import Packing, Transformer
from models.attention import segment_mask
from models.build import make_model
from models.embeddings import PositionalEncoding, sinusoidal_positions
from models.transformer import shift_right_per_segment
from training.losses import weighted_metrics
from training.optimizer import make_optimizer
from training.runtime import sharding
from training.state import initial_state, state_shardings
from training.steps import compile_train_step, translation_loss

# Without dropout, so that packed and unpacked rows run the same function.
CONFIG = dataclasses.replace(TINY_MODEL, dropout_rate=0.0, attention_dropout_rate=0.0)
LABEL_SMOOTHING = 0.1
# (source, target) ids of three pairs of different lengths, each ending with eos (3).
PAIRS = [
    ([5, 6, 7, 3], [11, 12, 3]),
    ([8, 9, 3], [13, 14, 15, 16, 3]),
    ([10, 11, 12, 13, 14, 3], [17, 3]),
]
# Pairs 0 and 2 share row 0, pair 1 has row 1; both rows end with padding.
PACKED_ROWS = [[0, 2], [1]]
PACKED_LENGTH = 12
UNPACKED_LENGTH = 8


def pack(pairs, rows, length):
    """The batch format of packed rows (issue 9), written out: NumPy [len(rows), length] int32 arrays."""
    batch = {}
    for side, name in ((0, 'inputs'), (1, 'targets')):
        ids, segment_ids, positions = (np.zeros((len(rows), length), np.int32) for _ in range(3))
        for row, members in enumerate(rows):
            start = 0
            for segment, pair in enumerate(members, start=1):
                sequence = pairs[pair][side]
                end = start + len(sequence)
                ids[row, start:end] = sequence
                segment_ids[row, start:end] = segment
                positions[row, start:end] = np.arange(len(sequence))
                start = end
        batch.update({name: ids, f'{name}_segment_ids': segment_ids, f'{name}_positions': positions})
    return batch


def unpacked(pairs, length):
    """One pair a row, padded to `length`: {'inputs', 'targets'} [len(pairs), length] int32."""
    return {name: pack(pairs, [[pair] for pair in range(len(pairs))], length)[name] for name in ('inputs', 'targets')}


def pair_locations(rows):
    """(row, segment id) of each pair in packed rows."""
    locations = {}
    for row, members in enumerate(rows):
        for segment, pair in enumerate(members, start=1):
            locations[pair] = (row, segment)
    return [locations[pair] for pair in sorted(locations)]


def init_params(config):
    batch = unpacked(PAIRS, UNPACKED_LENGTH)
    model = Transformer(config)
    variables = model.init(jax.random.key(0), batch['inputs'], batch['targets'], deterministic=True)
    return model, nn.unbox(variables['params'])


def per_pair_losses(model, params, batch, locations):
    """[pairs] each pair's summed label-smoothed target losses; `locations` are (row, segment id), None for one pair a
    row."""
    logits = model.apply(
        {'params': params}, batch['inputs'], batch['targets'], packing=Packing.from_batch(batch), deterministic=True
    )
    targets = batch['targets']
    if locations is None:
        pair_tokens = [(row, targets[row] != 0) for row in range(len(targets))]
    else:  # Padding has segment id 0.
        pair_tokens = [(row, batch['targets_segment_ids'][row] == segment) for row, segment in locations]
    return jnp.stack(
        [weighted_metrics(logits[row], targets[row], tokens, LABEL_SMOOTHING)['loss'] for row, tokens in pair_tokens]
    )


def gradient_atol(config, length, tokens, magnitude):
    """How far two evaluation orders can move a gradient of the summed loss of `tokens` target tokens.

    The backward pass retraces the forward path (the model, the log-softmax over the
    vocabulary) once more, and a weight's gradient adds one term per token.
    """
    forward = transformer_operations(config, length, length) + config.vocab_size
    return rounding_tolerance(2 * forward + tokens, magnitude)


# --------------------------------------------------------------------------- #
# The pieces: masks, shifted decoder inputs, positions.
# --------------------------------------------------------------------------- #


def test_segment_mask_matches_its_definition():
    rng = np.random.default_rng(0)
    query_segments = np.sort(rng.integers(1, 4, (3, 7)), axis=1)
    key_segments = np.sort(rng.integers(1, 4, (3, 9)), axis=1)
    query_segments[:, 5:] = 0  # Trailing padding.
    key_segments[:, 6:] = 0
    expected = np.zeros((3, 1, 7, 9), bool)
    for b in range(3):
        for q in range(7):
            for k in range(9):
                expected[b, 0, q, k] = key_segments[b, k] != 0 and query_segments[b, q] == key_segments[b, k]
    np.testing.assert_array_equal(segment_mask(jnp.asarray(query_segments), jnp.asarray(key_segments)), expected)


def test_decoder_inputs_restart_with_bos_in_each_segment():
    targets = jnp.array([[11, 12, 3, 13, 3, 0], [14, 15, 16, 3, 0, 0]])
    positions = jnp.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
    # Padding reads bos too (its positions are 0): harmless, padding attends to nothing.
    expected = [[2, 11, 12, 2, 13, 2], [2, 14, 15, 16, 2, 2]]
    np.testing.assert_array_equal(shift_right_per_segment(targets, positions, bos_id=2), expected)


def test_positional_encoding_reads_the_given_positions():
    positions = jnp.array([[0, 1, 2, 0, 1, 0]])
    embeddings = jnp.zeros((1, 6, 8))
    encoding = PositionalEncoding('sinusoidal', max_len=4)
    np.testing.assert_array_equal(
        encoding.apply({}, embeddings, positions=positions), sinusoidal_positions(4, 8)[positions]
    )
    # A row may be longer than the table; a position may not: it reads NaN, which the train step refuses.
    assert np.isnan(encoding.apply({}, embeddings, positions=positions.at[0, 2].set(4))[0, 2]).all()


def test_pack_writes_the_rows_grain_packs():
    """`pack` (the rows these tests feed the model) is grain's first-fit format, which the stream writes too."""
    examples = [
        {'inputs': np.array(source, np.int32), 'targets': np.array(target, np.int32)} for source, target in PAIRS
    ]
    packer = grain.experimental.FirstFitPackIterDataset(
        grain.MapDataset.source(examples).to_iter_dataset(),
        length_struct={'inputs': PACKED_LENGTH, 'targets': PACKED_LENGTH},
        num_packing_bins=2,
        shuffle_bins=False,
    )
    rows = list(packer)
    # First fit: pairs 0 and 1 share a row; pair 2's source no longer fits beside them.
    expected = pack(PAIRS, [[0, 1], [2]], PACKED_LENGTH)
    assert sorted(rows[0]) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(np.stack([row[key] for row in rows]), value, err_msg=key)


def test_packing_arrays_come_together():
    batch = pack(PAIRS, PACKED_ROWS, PACKED_LENGTH)
    assert Packing.from_batch(unpacked(PAIRS, UNPACKED_LENGTH)) is None
    del batch['targets_positions']
    with pytest.raises(ValueError, match='missing targets_positions'):
        Packing.from_batch(batch)


@pytest.mark.parametrize('key', ['inputs_segment_ids', 'targets_positions'])
def test_packing_arrays_must_match_their_sides_ids(key):
    batch = pack(PAIRS, PACKED_ROWS, PACKED_LENGTH)
    batch[key] = batch[key][:, :-1]
    side = key.split('_')[0]
    with pytest.raises(ValueError, match=re.escape(f"'{key}' has shape (2, 11), '{side}' (2, 12)")):
        Packing.from_batch(batch)


# --------------------------------------------------------------------------- #
# Segments do not see each other.
# --------------------------------------------------------------------------- #


def test_a_segment_cannot_influence_another():
    model, params = init_params(CONFIG)
    batch = pack(PAIRS, PACKED_ROWS, PACKED_LENGTH)
    packing = Packing.from_batch(batch)

    def outputs(batch):
        variables = {'params': params}
        inputs, targets = batch['inputs'], batch['targets']
        encoded = model.apply(variables, inputs, packing=packing, method=Transformer.encode, deterministic=True)
        logits = model.apply(variables, inputs, targets, packing=packing, deterministic=True)
        return np.asarray(encoded[0]), np.asarray(logits[0])

    encoded, logits = outputs(batch)
    # Padded queries attend to nothing (their rows of the masks are all False), yet stay finite.
    assert np.isfinite(encoded).all() and np.isfinite(logits).all()
    # Row 0 holds segment 1 (pair 0), then segment 2 (pair 2). Change a source and a target token of segment 1.
    changed = {'inputs': batch['inputs'].copy(), 'targets': batch['targets'].copy()}
    changed['inputs'][0, 1] = 20
    changed['targets'][0, 0] = 20
    changed_encoded, changed_logits = outputs(changed)

    source_2 = batch['inputs_segment_ids'][0] == 2
    target_2 = batch['targets_segment_ids'][0] == 2
    # Masked keys get exactly zero weight: segment 2's outputs are bit for bit the same ...
    np.testing.assert_array_equal(changed_encoded[source_2], encoded[source_2])
    np.testing.assert_array_equal(changed_logits[target_2], logits[target_2])
    # ... while segment 1's change (so the check above is not vacuous).
    source_1 = batch['inputs_segment_ids'][0] == 1
    target_1 = batch['targets_segment_ids'][0] == 1
    assert np.abs(changed_encoded[source_1] - encoded[source_1]).max() > 1e-3
    assert np.abs(changed_logits[target_1] - logits[target_1]).max() > 1e-3


# --------------------------------------------------------------------------- #
# Packed rows score each pair as its own row does: the same losses and gradients.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    'positional_encoding, norm_placement, attention',
    [
        ('sinusoidal', 'post', 'explicit'),
        ('sinusoidal', 'pre', 'explicit'),
        ('learned', 'post', 'explicit'),
        ('learned', 'pre', 'explicit'),
        # Packed rows through jax.nn.dot_product_attention, against the formula on unpacked rows.
        ('sinusoidal', 'post', 'xla'),
    ],
)
def test_packed_rows_give_the_losses_and_gradients_of_unpacked_rows(positional_encoding, norm_placement, attention):
    config = dataclasses.replace(CONFIG, positional_encoding=positional_encoding, norm_placement=norm_placement)
    model, params = init_params(config)
    packed_model = Transformer(dataclasses.replace(config, attention_implementation=attention))
    packed = pack(PAIRS, PACKED_ROWS, PACKED_LENGTH)
    locations = tuple(pair_locations(PACKED_ROWS))

    @functools.partial(jax.jit, static_argnums=(0, 3))
    def losses_and_grads(model, params, batch, locations):
        def summed(params):
            losses = per_pair_losses(model, params, batch, locations)
            return jnp.sum(losses), losses

        (_, losses), grads = jax.value_and_grad(summed, has_aux=True)(params)
        return losses, grads

    packed_losses, packed_grads = losses_and_grads(packed_model, params, packed, locations)
    losses, grads = losses_and_grads(model, params, unpacked(PAIRS, UNPACKED_LENGTH), None)

    tokens = sum(len(target) for _, target in PAIRS)
    for pair, (_, target) in enumerate(PAIRS):
        rtol = loss_rtol(config, length=PACKED_LENGTH, tokens=len(target))
        np.testing.assert_allclose(packed_losses[pair], losses[pair], rtol=rtol)
    assert np.all(np.asarray(losses) > 1.0)  # Untrained: no pair's loss is near 0, so the check is not vacuous.

    def assert_close(path, packed_grad, grad):
        atol = gradient_atol(config, PACKED_LENGTH, tokens, magnitude=float(np.abs(grad).max()))
        np.testing.assert_allclose(packed_grad, grad, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))

    jax.tree.map_with_path(assert_close, packed_grads, grads)
    if positional_encoding == 'learned':
        # Only the positions of real source tokens get gradients (padding reads position 0 but carries none).
        position_grads = np.abs(packed_grads['encoder']['position_embedding']['embedding']).max(axis=1)
        longest = max(len(source) for source, _ in PAIRS)
        assert np.all(position_grads[:longest] > 0) and np.all(position_grads[longest:] == 0)


def test_train_step_on_packed_rows_equals_the_step_on_unpacked_rows(compilation_cache):
    """`translation_loss` reads the packing keys, through the mesh-sharded (jit) train step as the loop compiles it.

    One layer a stack: the model's packing through two is the test above's. The compilation cache: both runs' initial
    states are the same program.
    """
    config = default.get_config()
    config.dataset.max_length = config.eval.max_decode_length = CONFIG.max_len
    config.model.update(
        d_model=32, num_heads=4, d_ff=64, num_layers=1, dropout_rate=0.0, attention_dropout_rate=0.0, dtype="float32"
    )
    config.optimizer.update(schedule="rsqrt", peak_learning_rate=3e-3, warmup_steps=1)
    model = make_model(config, vocab_size=CONFIG.vocab_size)
    tx, schedule = make_optimizer(config.optimizer, d_model=config.model.d_model)
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    shardings = state_shardings(config, model, tx, mesh)
    step = compile_train_step(
        'jit',
        mesh,
        config.mesh.rules,
        shardings,
        loss_fn=functools.partial(translation_loss, model=model, label_smoothing=LABEL_SMOOTHING),
        tx=tx,
        learning_rate_fn=schedule,
    )

    def run(batch):
        state = step.enter(initial_state(config, model, tx, shardings))
        return jax.device_get(step.run(state, step.place_batch(batch), jax.random.key(1))[1])

    packed_metrics = run(pack(PAIRS, PACKED_ROWS, PACKED_LENGTH))
    metrics = run(unpacked(PAIRS, UNPACKED_LENGTH))

    tokens = sum(len(target) for _, target in PAIRS)
    assert packed_metrics['tokens'] == metrics['tokens'] == tokens
    rtol = loss_rtol(model.config, length=PACKED_LENGTH, tokens=tokens)
    np.testing.assert_allclose(packed_metrics['loss'], metrics['loss'], rtol=rtol)
    assert packed_metrics['accuracy'] == metrics['accuracy']
    # The norm of the whole gradient (divided by the tokens): each element within `gradient_atol` of its own scale.
    rtol = gradient_atol(model.config, PACKED_LENGTH, tokens, magnitude=1.0)
    np.testing.assert_allclose(packed_metrics['grad_norm'], metrics['grad_norm'], rtol=rtol)
    assert packed_metrics['finite'] and metrics['finite']

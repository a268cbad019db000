"""Rotary and relative positions (models/positions.py) and a smaller key size d_k (model.key_dim).

The formulas against NumPy transcriptions of the papers, the shift invariance they are
built for, and the model around them: packed rows, cached decoding, beam search,
attention maps, sharded training, the config's checks.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL, random_params, tiny_config
from decoding_programs import cached_step_logits_program, decoding_program
from test_packing import (
    PACKED_LENGTH,
    PACKED_ROWS,
    PAIRS,
    UNPACKED_LENGTH,
    gradient_atol,
    pack,
    pair_locations,
    per_pair_losses,
    unpacked,
)
from tolerances import loss_rtol, rounding_tolerance, transformer_operations

from common.errors import UserInputError
from models import Classifier, ClassifierConfig, Transformer
from models.attention import MultiHeadAttention, causal_mask, dot_product_attention, segment_mask
from models.beam_search import BeamSearch
from models.build import make_model
from models.decoding_checks import decoding_memory_bytes
from models.positions import RelativeTerms, relative_distances, rotate
from models.search import SpecialIds
from models.token_search import TokenSearch, argmax_token
from training.config_checks import validate_config
from training.reporting import attention_weights

BOS, EOS, PAD = 2, 3, 0
# The model variants under test: relative with a small clip (so that clipping happens in
# these short rows), relative values and a d_k unlike d_v; rotary; and a smaller d_k alone.
VARIANTS = {
    'relative': dict(positional_encoding='relative', relative_clip=2, relative_values=True, key_dim=4),
    'relative, keys only': dict(positional_encoding='relative'),
    'rotary': dict(positional_encoding='rotary'),
    'sinusoidal, key_dim 4': dict(positional_encoding='sinusoidal', key_dim=4),
}


def _config(variant: str, **changes):
    no_dropout = dict(dropout_rate=0.0, attention_dropout_rate=0.0)
    return dataclasses.replace(TINY_MODEL, **{**no_dropout, **VARIANTS[variant], **changes})


# For the tests of what each layer does with positions: the same in every layer. Stacked layers are
# test_cached_step_logits_equal_the_full_decoder's (every layer's cache) and, for packed rows, the two-layer
# packed-rows test of tests/test_packing.py.
ONE_LAYER = dict(num_encoder_layers=1, num_decoder_layers=1)


# --------------------------------------------------------------------------- #
# Rotary positions (Su et al., 2021).
# --------------------------------------------------------------------------- #


def numpy_rotation(position: int, dim: int) -> np.ndarray:
    """R^d_{Theta,m} of eq. 15: 2 x 2 rotations by m * theta_i on the diagonal, theta_i = 10000^(-2i/d)."""
    rotation = np.zeros((dim, dim))
    for i in range(dim // 2):
        angle = position * 10000.0 ** (-2 * i / dim)
        rotation[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [
            [np.cos(angle), -np.sin(angle)],
            [np.sin(angle), np.cos(angle)],
        ]
    return rotation


def rotary_atol(max_position: int, magnitude: float) -> float:
    """float32 against float64 for vectors of `magnitude` rotated at positions up to `max_position`.

    The angle m * theta_i (theta_i <= 1) is off by ~eps * m from rounding theta_i and the product,
    which moves a rotated component by |x| eps m per sin or cos; sin, cos, two products and a sum
    add a few roundings more.
    """
    return rounding_tolerance(2 * max_position + 6, magnitude)


def test_rotate_is_the_papers_block_diagonal_rotation():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 8))  # [batch, length, heads, dim]
    positions = rng.integers(0, 50, (2, 5))
    rotated = rotate(jnp.asarray(x, jnp.float32), jnp.asarray(positions))
    expected = np.einsum('blij,blhj->blhi', np.vectorize(numpy_rotation, signature='(),()->(d,d)')(positions, 8), x)
    assert rotated.dtype == jnp.float32
    np.testing.assert_allclose(rotated, expected, rtol=0, atol=rotary_atol(50, np.abs(x).max()))
    # A rotation keeps lengths, and position 0 is the identity.
    np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(rotate(jnp.asarray(x, jnp.float32), jnp.zeros((2, 5), int)), x, rtol=1e-6)


def test_rotary_logits_are_the_queries_against_keys_rotated_by_the_distance():
    """<R_m q, R_n k> = q^T R_{n-m} k (eq. 16): the logit of query position m and key position n."""
    rng = np.random.default_rng(1)
    query, key = rng.normal(size=(2, 1, 4, 1, 8))  # One query and four keys, [batch=1, length, heads=1, dim].
    query_positions, key_positions = np.array([[7]]), np.array([[0, 5, 7, 30]])
    logits = jnp.einsum(
        'bqhd,bkhd->bqk',
        rotate(jnp.asarray(query[:, :1], jnp.float32), jnp.asarray(query_positions)),
        rotate(jnp.asarray(key, jnp.float32), jnp.asarray(key_positions)),
    )[0, 0]
    expected = [query[0, 0, 0] @ numpy_rotation(n - 7, 8) @ key[0, j, 0] for j, n in enumerate(key_positions[0])]
    magnitude = np.linalg.norm(query[0, 0]) * np.linalg.norm(key, axis=-1).max()
    np.testing.assert_allclose(
        logits, expected, rtol=0, atol=rotary_atol(30, magnitude) + rounding_tolerance(8, magnitude)
    )


# --------------------------------------------------------------------------- #
# Relative position representations (Shaw, Uszkoreit and Vaswani, 2018).
# --------------------------------------------------------------------------- #


def test_relative_distances_are_clipped_key_minus_query():
    distances = relative_distances(jnp.array([[0, 1, 5]]), jnp.array([[0, 1, 2, 3, 9]]), clip=2)
    # clip(j - i, -2, 2) + 2 for queries at 0, 1, 5 and keys at 0, 1, 2, 3, 9.
    expected = [[2, 3, 4, 4, 4], [1, 2, 3, 4, 4], [0, 0, 0, 0, 4]]
    np.testing.assert_array_equal(distances[0], expected)


def numpy_relative_attention(query, key, value, key_table, value_table, query_positions, key_positions, clip, mask):
    """Shaw et al.'s eqs. 2-5 written out per element: a_ij = w_clip(j - i, k), e_ij = q_i (k_j + a^K_ij)^T / sqrt(d_k),
    z_i = sum_j alpha_ij (v_j + a^V_ij)."""
    batch, q_len, heads, d_k = query.shape
    kv_len, d_v = key.shape[1], value.shape[-1]
    output = np.zeros((batch, q_len, heads, d_v))
    weights = np.zeros((batch, heads, q_len, kv_len))
    for b in range(batch):
        for h in range(heads):
            for i in range(q_len):
                logits = np.zeros(kv_len)
                relative_v = np.zeros((kv_len, d_v))
                for j in range(kv_len):
                    r = min(max(key_positions[b, j] - query_positions[b, i], -clip), clip) + clip
                    logits[j] = query[b, i, h] @ (key[b, j, h] + key_table[r]) / np.sqrt(d_k)
                    relative_v[j] = value_table[r]
                logits = np.where(mask[b, 0, i], logits, -1e30)
                alpha = np.exp(logits - logits.max())
                alpha /= alpha.sum()
                weights[b, h, i] = alpha
                output[b, i, h] = alpha @ (value[b, :, h] + relative_v)
    return output, weights


def test_relative_attention_matches_shaw_et_al():
    rng = np.random.default_rng(2)
    batch, length, heads, d_k, d_v, clip = 2, 7, 3, 4, 6, 2
    query, key = rng.normal(size=(2, batch, length, heads, d_k))
    value = rng.normal(size=(batch, length, heads, d_v))
    key_table, value_table = rng.normal(size=(2 * clip + 1, d_k)), rng.normal(size=(2 * clip + 1, d_v))
    # Row 0 packs two sequences (positions restart); row 1 is one sequence and padding.
    segments = np.array([[1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 0, 0]])
    positions = np.array([[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 0, 0]])
    mask = np.asarray(causal_mask(length) & segment_mask(jnp.asarray(segments), jnp.asarray(segments)))
    relative = RelativeTerms(
        relative_distances(jnp.asarray(positions), jnp.asarray(positions), clip),
        jnp.asarray(key_table, jnp.float32),
        jnp.asarray(value_table, jnp.float32),
    )
    output, weights = dot_product_attention(
        *(jnp.asarray(x, jnp.float32) for x in (query, key, value)), jnp.asarray(mask), relative=relative
    )
    expected_output, expected_weights = numpy_relative_attention(
        query, key, value, key_table, value_table, positions, positions, clip, mask
    )
    # As in test_attention: the d_k-term scores (now of k_j + a^K_ij, one more rounding), softmax's max and
    # sum; then the weighted sums of v_j and of the summed a^V buckets, each of at most `length` terms.
    scores = np.abs(query).max() * (np.abs(key).max() + np.abs(key_table).max()) * np.sqrt(d_k)
    weight_tolerance = rounding_tolerance(d_k + 2 * length + 2, magnitude=max(1.0, scores))
    np.testing.assert_allclose(weights, expected_weights, rtol=weight_tolerance, atol=0)
    values = np.abs(value).max() + np.abs(value_table).max()
    output_tolerance = rounding_tolerance(2 * length, magnitude=values) + weight_tolerance * values * length
    np.testing.assert_allclose(output, expected_output, rtol=0, atol=output_tolerance)
    # Clipping matters here (distances up to 4 > clip) and the value table contributes.
    without_values, _ = dot_product_attention(
        *(jnp.asarray(x, jnp.float32) for x in (query, key, value)),
        jnp.asarray(mask),
        relative=relative._replace(value_table=None),
    )
    assert np.abs(without_values - output).max() > 0.1


# --------------------------------------------------------------------------- #
# Only the distance matters: shifting every position changes nothing.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize('kind', ['relative', 'rotary'])
def test_shifting_every_position_leaves_the_attention_unchanged(kind):
    layer = MultiHeadAttention(num_heads=4, d_model=32, positions=kind, relative_clip=3, relative_values=True)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 6, 32)), jnp.float32)
    positions = jnp.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]])
    mask = causal_mask(6)
    params = layer.init(
        jax.random.key(0), x, x, mask, deterministic=True, query_positions=positions, key_positions=positions
    )
    assert ('relative_positions' in params['params']) == (kind == 'relative')

    def attention(offset):
        shifted = positions + offset
        output, state = layer.apply(
            params,
            x,
            x,
            mask,
            deterministic=True,
            query_positions=shifted,
            key_positions=shifted,
            mutable=['intermediates'],
        )
        (weights,) = state['intermediates']['attention_weights']
        return np.asarray(output), np.asarray(weights)

    output, weights = attention(0)
    for offset in (1, 37, 500):
        shifted_output, shifted_weights = attention(offset)
        if kind == 'relative':  # The same integer distances: bit for bit.
            np.testing.assert_array_equal(shifted_weights, weights)
            np.testing.assert_array_equal(shifted_output, output)
        else:
            # Rotated at positions up to 505, queries and keys of norm ~ sqrt(d_model) ...
            query_key = rotary_atol(offset + 5, magnitude=32.0)
            # ... move the logits by |q| |k| times that, the softmax passing it on relatively.
            np.testing.assert_allclose(shifted_weights, weights, rtol=query_key, atol=0)
            np.testing.assert_allclose(shifted_output, output, rtol=0, atol=query_key * np.abs(output).max() * 6)
    # Changing one distance does change the attention (the check is not vacuous).
    moved = positions.at[0, 5].set(7)
    other, _ = layer.apply(params, x, x, mask, deterministic=True, query_positions=moved, key_positions=moved)
    assert np.abs(np.asarray(other)[0, 5] - output[0, 5]).max() > 1e-3


# --------------------------------------------------------------------------- #
# The model: packed rows, decoding, attention maps.
# --------------------------------------------------------------------------- #


def _init(config, length=UNPACKED_LENGTH):
    """The model and random parameters of its shapes (NumPy: Flax's eager init would compile an operation at a
    time); what these tests check holds for any parameters."""
    model = Transformer(config)
    ids = np.full((1, length), 5, np.int32)
    return model, random_params(model, ids, ids)


@pytest.mark.parametrize('variant', ['relative', 'rotary'])
def test_packed_rows_give_the_losses_and_gradients_of_unpacked_rows(variant):
    """Each pair's relative distances and rotations are those of its own row.

    Positions counted along the packed row would do as well (only differences count, and
    the masks keep segments apart); query and key positions that disagree would not.
    """
    config = _config(variant, **ONE_LAYER)
    model, params = _init(config)
    # No absolute positions: nothing is added to the embeddings.
    assert 'position_embedding' not in params['encoder'] and 'position_embedding' not in params['decoder']
    packed = pack(PAIRS, PACKED_ROWS, PACKED_LENGTH)

    @functools.partial(jax.jit, static_argnums=2)
    def losses_and_grads(params, batch, locations):
        def summed(params):
            losses = per_pair_losses(model, params, batch, locations)
            return jnp.sum(losses), losses

        (_, losses), grads = jax.value_and_grad(summed, has_aux=True)(params)
        return losses, grads

    packed_losses, packed_grads = losses_and_grads(params, packed, tuple(pair_locations(PACKED_ROWS)))
    losses, grads = losses_and_grads(params, unpacked(PAIRS, UNPACKED_LENGTH), None)
    for pair, (_, target) in enumerate(PAIRS):
        rtol = loss_rtol(config, length=PACKED_LENGTH, tokens=len(target))
        np.testing.assert_allclose(packed_losses[pair], losses[pair], rtol=rtol)
    tokens = sum(len(target) for _, target in PAIRS)

    def assert_close(path, packed_grad, grad):
        atol = gradient_atol(config, PACKED_LENGTH, tokens, magnitude=float(np.abs(grad).max()))
        np.testing.assert_allclose(packed_grad, grad, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))

    jax.tree.map_with_path(assert_close, packed_grads, grads)
    assert np.all(np.asarray(losses) > 1.0)  # Untrained: no pair's loss is near 0, so the check is not vacuous.


def _decoding_model(variant, **changes):
    config = _config(variant, vocab_size=40, max_len=32, norm_placement='pre', **changes)
    model = Transformer(config)
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.integers(4, 40, (3, 9)), jnp.int32).at[1, 6:].set(PAD)
    params = nn.unbox(model.init(jax.random.key(1), inputs, inputs, deterministic=True)['params'])
    return model, params, inputs


@pytest.mark.parametrize('variant', list(VARIANTS))
def test_cached_step_logits_equal_the_full_decoder(variant):
    model, params, inputs = _decoding_model(variant)
    length = 7  # Beyond relative_clip = 2: cached steps see clipped distances.
    decoder_inputs = jnp.asarray(np.random.default_rng(2).integers(4, 40, (3, length)), jnp.int32).at[:, 0].set(BOS)
    # The cache's shapes alone (eval_shape runs nothing): its keys have size d_k.
    encoded = jax.ShapeDtypeStruct((*inputs.shape, model.config.d_model), jnp.float32)
    init_cache = functools.partial(model.apply, method=Transformer.init_cache, max_length=length)
    cache = jax.eval_shape(init_cache, {'params': params}, encoded)
    d_k = VARIANTS[variant].get('key_dim', 0) or model.config.d_v
    assert cache['layers_0']['self_key'].shape[-1] == cache['layers_0']['cross_key'].shape[-1] == d_k
    full, stepped = cached_step_logits_program(model, length)(params, inputs, decoder_inputs)
    operations = transformer_operations(model.config, inputs.shape[1], length)
    atol = rounding_tolerance(operations, magnitude=max(1.0, float(np.abs(full).max())))
    for position in range(length):
        np.testing.assert_allclose(
            stepped[:, position], full[:, position], rtol=0, atol=atol, err_msg=f'position {position}'
        )


@pytest.mark.parametrize('variant', ['relative', 'rotary'])
def test_cached_greedy_and_beam_search_equal_their_uncached_runs(variant):
    model, params, inputs = _decoding_model(variant, **ONE_LAYER)
    # Larger weights make an untrained model's choices depend on the source and the prefix.
    params = jax.tree.map(lambda x: 5.0 * x, params)
    special = SpecialIds(bos=BOS, eos=EOS, pad=0)
    greedy, beam = TokenSearch(argmax_token, special), BeamSearch(3, 0.6, special, settled=3)

    def decode(search, use_cache):
        return decoding_program(search, model, 10, use_cache)(params, inputs)

    cached = greedy.best(decode(greedy, True))
    assert len(np.unique(np.asarray(cached))) >= 5, cached  # Not one token repeated.
    np.testing.assert_array_equal(cached, greedy.best(decode(greedy, False)))
    (tokens, scores), (uncached_tokens, uncached_scores) = (
        (beams.finished_tokens[..., 1:], beams.finished_scores) for beams in (decode(beam, True), decode(beam, False))
    )
    assert tokens.shape == (3, 3, 10) and np.all(np.asarray(scores) > -1e8)
    # The best hypotheses are the same. A lower one may be another with the same score up to
    # rounding (a near tie with a candidate the beam drops): with LLVM's code generation
    # unoptimized, the third of three was (4 32 32 4 …) in one run and (4 32 4 32 …) in the other.
    np.testing.assert_array_equal(tokens[:, 0], uncached_tokens[:, 0])
    operations = transformer_operations(model.config, inputs.shape[1], 10) * 10  # Ten steps' log-probabilities.
    np.testing.assert_allclose(scores, uncached_scores, rtol=rounding_tolerance(operations), atol=0)


def test_the_decoding_memory_estimate_counts_keys_of_size_d_k():
    """As test_user_errors' check for d_k = d_v: the estimate's cache terms are the bytes of the cache built."""
    config = _config('relative')  # d_k 4, d_v 8.
    model, params = _init(config)
    batch, source_length, max_length = 3, 5, 7
    encoded = jax.ShapeDtypeStruct((batch, source_length, config.d_model), jnp.float32)
    cache = jax.eval_shape(
        lambda e: model.apply({'params': params}, e, max_length, method=Transformer.init_cache), encoded
    )
    self_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache) if leaf.shape[2] == max_length)
    cache_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))
    logits = batch * config.vocab_size * 4
    estimate = decoding_memory_bytes(
        config, batch_size=batch, beam_size=1, source_length=source_length, max_length=max_length
    )
    assert estimate == cache_bytes + self_bytes + logits  # The self-attention part twice (decoding.py).


@pytest.mark.parametrize('variant', ['relative', 'rotary'])
def test_attention_maps_of_the_new_kinds(variant):
    config = _config(variant, num_decoder_layers=1, num_encoder_layers=1)
    model, params = _init(config)
    source, target = np.array([5, 6, 7, 8, 9, EOS]), np.array([10, 11, 12, EOS])
    weights = attention_weights.attention_weights(model, params, source, target)
    assert list(weights) == [
        'encoder/layer_0/self_attention',
        'decoder/layer_0/self_attention',
        'decoder/layer_0/cross_attention',
    ]
    shapes = [(4, 6, 6), (4, 4, 4), (4, 4, 6)]
    for (name, w), shape in zip(weights.items(), shapes, strict=True):
        assert w.shape == shape, name
        np.testing.assert_allclose(w.sum(axis=-1), 1.0, rtol=1e-5, err_msg=name)
    assert np.all(np.triu(weights['decoder/layer_0/self_attention'], k=1) == 0.0)


@pytest.mark.parametrize('variant', ['relative', 'rotary'])
def test_the_classifier_ignores_padding(variant):
    """The encoder alone (models/classifier.py, [CLS] pooling): positions 0, 1, ... of each row, padding masked."""
    encoder = _config(variant, num_encoder_layers=1, num_decoder_layers=0)  # What a layer does with positions.
    config = ClassifierConfig(encoder, num_classes=5, pooling='cls')
    model = Classifier(config)
    rows = np.array([[5, 6, 7, EOS, PAD, PAD], [8, 9, 10, 11, 12, EOS]], np.int32)
    params = nn.unbox(model.init(jax.random.key(0), rows, deterministic=True)['params'])
    classify = jax.jit(functools.partial(model.apply, deterministic=True))  # A program a length, not an op at a time.
    short = classify({'params': params}, rows)
    long = classify({'params': params}, np.pad(rows, ((0, 0), (0, 10))))
    operations = transformer_operations(config.encoder, 16, 0)
    np.testing.assert_allclose(short, long, rtol=0, atol=rounding_tolerance(operations, max(1.0, np.abs(short).max())))


# --------------------------------------------------------------------------- #
# The config.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize('kind', ['relative', 'rotary'])
def test_the_config_builds_the_kind_it_names(kind):
    config = tiny_config(**{'model.positional_encoding': kind, 'model.key_dim': 8, 'model.relative_values': True})
    validate_config(config, num_devices=1)
    model_config = make_model(config, vocab_size=config.tokenizer.vocab_size).config
    assert (model_config.positional_encoding, model_config.d_k, model_config.d_v) == (kind, 8, 16)
    assert (model_config.relative_clip, model_config.relative_values) == (16, True)


@pytest.mark.parametrize(
    'overrides, message',
    [
        ({'model.positional_encoding': 'alibi'}, r"config\.model\.positional_encoding is 'alibi'; choose one of"),
        ({'model.key_dim': -1}, r'config\.model\.key_dim is -1; it must be a per-head query/key size >= 1, or 0'),
        ({'model.relative_clip': 0}, r'config\.model\.relative_clip is 0; it must be a distance >= 1'),
        (
            {'model.positional_encoding': 'rotary', 'model.key_dim': 5},
            r"'rotary' rotates pairs of query/key dimensions, but each head has 5 .*; make it even",
        ),
    ],
)
def test_bad_position_and_key_fields_are_named(overrides, message):
    with pytest.raises(UserInputError, match=message):
        validate_config(tiny_config(**overrides), num_devices=1)


def test_a_key_size_the_mesh_cannot_split_is_named():
    rules = (*tiny_config().mesh.rules, ('kv', 'tensor'))
    rules = tuple(rule for rule in rules if rule != ('kv', None))
    validate_config(tiny_config(**{'mesh.rules': rules, 'mesh.tensor': 2}), num_devices=8)
    with pytest.raises(UserInputError, match=r"query/key size d_k .* is 5, not divisible by 2, .* split 'kv' over"):
        validate_config(tiny_config(**{'mesh.rules': rules, 'mesh.tensor': 2, 'model.key_dim': 5}), num_devices=8)

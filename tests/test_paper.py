"""What "Attention Is All You Need" (Vaswani et al., 2017) specifies, pinned on the real model and train step.

Each test is named after one statement of the paper (its section in the docstring) and checks
the tiny model of conftest.py, the train step or the configs against a NumPy transcription of
the statement. Intermediate tensors are read with `nn.intercept_methods` (the real modules run;
the interceptor only records their inputs and outputs), so the model is never re-implemented here.
"""

import contextlib
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_MODEL as TINY
from conftest import random_params, tiny_config
from tolerances import loss_rtol, rounding_tolerance, transformer_operations

from configs import default
from models import Transformer
from models.attention import MultiHeadAttention
from models.build import make_model
from models.embeddings import PositionalEncoding, sinusoidal_positions
from models.layers import DecoderLayer, EncoderLayer, FeedForward
from models.transformer import Decoder, Encoder, shift_right
from training.optimizer import make_optimizer
from training.state import TrainState
from training.steps import train_step
from training.tasks.translation import TranslationTask

# Pad 0 trails the real tokens; every sequence ends with eos 3.
INPUTS = jnp.array([[5, 6, 7, 8, 3, 0], [9, 10, 3, 0, 0, 0]], dtype=jnp.int32)
TARGETS = jnp.array([[11, 12, 13, 3, 0], [14, 3, 0, 0, 0]], dtype=jnp.int32)
# The sub-layers of a layer in the order they run, each followed by its LayerNorm '<name>_norm'.
SUBLAYERS = {
    'encoder': ('self_attention', 'feed_forward'),
    'decoder': ('self_attention', 'cross_attention', 'feed_forward'),
}


def init(config=TINY):
    model = Transformer(config)
    return model, nn.unbox(model.init(jax.random.key(0), INPUTS, TARGETS, deterministic=True)['params'])


@dataclasses.dataclass
class Call:
    """One recorded `__call__` of a module: where, on what, with what result."""

    module: nn.Module
    path: str  # 'decoder/layers_1/cross_attention'
    args: tuple
    kwargs: dict
    output: jax.Array


@contextlib.contextmanager
def recorded_calls(*module_types: type[nn.Module], dropout_off: bool = False):
    """Records, in the order they return, the calls of modules of `module_types` while the model runs.

    With `dropout_off`, every nn.Dropout returns its input unchanged, whatever its rate.
    """
    calls = []

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name != '__call__':
            return next_fun(*args, **kwargs)
        if dropout_off and isinstance(context.module, nn.Dropout):
            output = args[0]
        else:
            output = next_fun(*args, **kwargs)
        if isinstance(context.module, module_types):
            calls.append(Call(context.module, '/'.join(context.module.path), args, kwargs, output))
        return output

    with nn.intercept_methods(interceptor):
        yield calls


def apply(model, params, *, deterministic: bool, seed: int = 1):
    rngs = None if deterministic else {'dropout': jax.random.key(seed)}
    return model.apply({'params': params}, INPUTS, TARGETS, deterministic=deterministic, rngs=rngs)


def f64(x) -> np.ndarray:
    return np.asarray(x, np.float64)


def layer_norm(x, norm_params) -> np.ndarray:
    """LayerNorm (Ba et al., 2016) over the last axis, in float64: (x - mean) / sqrt(var + 1e-6) * scale + bias."""
    x = f64(x)
    centred = x - x.mean(-1, keepdims=True)
    return centred / np.sqrt(x.var(-1, keepdims=True) + 1e-6) * f64(norm_params['scale']) + f64(norm_params['bias'])


def layer_norm_atol(x, norm_params) -> float:
    """How far float32 LayerNorm of `x` can be from the float64 one.

    Mean and variance each sum d_model terms; the variance as E[x²] - E[x]² loses
    (max|x| / std)² of its relative precision to cancellation; the normalized value
    (up to max|x| / std) carries both, times |scale|, plus bias's rounding.
    """
    x = f64(x)
    ratio = np.max(np.abs(x).max(-1) / x.std(-1))
    magnitude = np.abs(norm_params['scale']).max() * ratio * (1 + ratio**2) + np.abs(norm_params['bias']).max()
    return rounding_tolerance(2 * x.shape[-1] + 4, magnitude)


def with_random_layer_norms(params, seed: int = 0):
    """`params` with every LayerNorm's scale and bias drawn at random, so that a formula has to apply them."""
    rng = np.random.default_rng(seed)

    def visit(tree, name):
        if not isinstance(tree, dict):
            return tree
        if name.endswith('norm'):
            return {
                'scale': jnp.asarray(1.0 + 0.5 * rng.standard_normal(tree['scale'].shape), jnp.float32),
                'bias': jnp.asarray(0.5 * rng.standard_normal(tree['bias'].shape), jnp.float32),
            }
        return {key: visit(value, key) for key, value in tree.items()}

    return visit(params, '')


def subtree(tree: dict, path: str):
    """The entry of nested dicts (parameters, gradients) at `path` ('decoder/layers_0/feed_forward_norm')."""
    for name in path.split('/'):
        tree = tree[name]
    return tree


# --------------------------------------------------------------------------- #
# Embeddings and the output layer (section 3.4).
# --------------------------------------------------------------------------- #


def test_embeddings_are_multiplied_by_sqrt_d_model_and_positional_encodings_added():
    """Section 3.4: "In the embedding layers, we multiply those weights by √d_model"; section 3.5: the
    positional encodings "are added to the input embeddings at the bottoms of the encoder and decoder stacks".

    The first layer of each stack sees E[ids] · √d_model + PE[position], with E the one matrix
    (tied) that embeds the source and the decoder's shifted target.
    """
    model, params = init()
    with recorded_calls(EncoderLayer, DecoderLayer) as calls:
        apply(model, params, deterministic=True)
    first_layer_input = {call.path: call.args[0] for call in calls}
    embedding = f64(params['shared_embedding']['embedding'])
    table = f64(sinusoidal_positions(TINY.max_len, TINY.d_model))
    for path, ids in (('encoder/layers_0', INPUTS), ('decoder/layers_0', shift_right(TARGETS, TINY.bos_id))):
        expected = embedding[np.asarray(ids)] * np.sqrt(TINY.d_model) + table[: ids.shape[1]]
        # Three roundings: √d_model, the product, the sum.
        atol = rounding_tolerance(3, np.abs(expected).max())
        np.testing.assert_allclose(first_layer_input[path], expected, rtol=0, atol=atol, err_msg=path)


def test_tied_output_logits_are_the_decoder_output_times_the_embedding_matrix_transposed():
    """Section 3.4: "we share the same weight matrix between the two embedding layers and the pre-softmax
    linear transformation": logits = h · Eᵀ, with h the decoder stack's output (not scaled by √d_model)."""
    model, params = init()
    with recorded_calls(Decoder) as calls:
        logits = apply(model, params, deterministic=True)
    (decoder,) = calls
    hidden, embedding = f64(decoder.output), f64(params['shared_embedding']['embedding'])
    expected = hidden @ embedding.T  # [batch, tgt_len, vocab]
    # Each logit sums d_model products.
    atol = rounding_tolerance(TINY.d_model, (np.abs(hidden) @ np.abs(embedding).T).max())
    np.testing.assert_allclose(logits, expected, rtol=0, atol=atol)


# --------------------------------------------------------------------------- #
# The residual connections, LayerNorm and dropout around each sub-layer (sections 3.1, 5.4).
# --------------------------------------------------------------------------- #


def check_post_ln_layer(layer: Call, sublayers: list[Call], dropouts: list[Call], norms: list) -> None:
    """x ← LN(x + Dropout(Sublayer(x))) for each sub-layer, x starting at the layer's input.

    Each step starts from the real stream (what the next sub-layer was given), so the check stays local.
    """
    streams = [sublayer.args[0] for sublayer in sublayers] + [layer.output]
    np.testing.assert_array_equal(streams[0], layer.args[0])
    for k, (dropout, norm) in enumerate(zip(dropouts, norms, strict=True)):
        residual_sum = f64(streams[k]) + f64(dropout.output)
        np.testing.assert_allclose(
            streams[k + 1],
            layer_norm(residual_sum, norm),
            rtol=0,
            atol=layer_norm_atol(residual_sum, norm),
            err_msg=f'after {sublayers[k].path}',
        )


def check_pre_ln_layer(layer: Call, sublayers: list[Call], dropouts: list[Call], norms: list) -> None:
    """x ← x + Dropout(Sublayer(LN(x))) for each sub-layer, x starting at the layer's input."""
    x = f64(layer.args[0])
    for sublayer, dropout, norm in zip(sublayers, dropouts, norms, strict=True):
        np.testing.assert_allclose(
            sublayer.args[0], layer_norm(x, norm), rtol=0, atol=layer_norm_atol(x, norm), err_msg=sublayer.path
        )
        x = x + f64(dropout.output)
    # One rounded sum per sub-layer.
    atol = rounding_tolerance(len(sublayers), np.abs(x).max() + max(np.abs(d.output).max() for d in dropouts))
    np.testing.assert_allclose(layer.output, x, rtol=0, atol=atol, err_msg=layer.path)


@pytest.mark.parametrize('norm_placement', ['post', 'pre'])
def test_each_sublayer_output_is_layer_norm_of_x_plus_dropout_of_sublayer_of_x(norm_placement):
    """Section 3.1: "the output of each sub-layer is LayerNorm(x + Sublayer(x))"; section 5.4: "We apply
    dropout to the output of each sub-layer, before it is added to the sub-layer input and normalized."

    post (the paper): x ← LN(x + Dropout(Sublayer(x))), and the stack's output is the last x.
    pre (the variant): x ← x + Dropout(Sublayer(LN(x))), and the stack ends with a LayerNorm.
    Checked in training mode (dropout on), with random LayerNorm scales and biases, on every layer
    of both stacks, from the tensors the real sub-layers and dropouts produced.
    """
    model, params = init(dataclasses.replace(TINY, norm_placement=norm_placement))
    params = with_random_layer_norms(params)
    modules = (Encoder, Decoder, EncoderLayer, DecoderLayer, MultiHeadAttention, FeedForward, nn.Dropout)
    with recorded_calls(*modules) as calls:
        apply(model, params, deterministic=False)

    def calls_under(path, *types):
        return [call for call in calls if call.path.startswith(path + '/') and isinstance(call.module, types)]

    check_layer = check_post_ln_layer if norm_placement == 'post' else check_pre_ln_layer
    for stack in ('encoder', 'decoder'):
        layers = calls_under(stack, EncoderLayer, DecoderLayer)
        assert [layer.path for layer in layers] == [f'{stack}/layers_{i}' for i in range(2)]
        for layer in layers:
            sublayers = calls_under(layer.path, MultiHeadAttention, FeedForward)
            names = [sublayer.path.rsplit('/', 1)[1] for sublayer in sublayers]
            assert names == list(SUBLAYERS[stack]), layer.path
            norms = [subtree(params, f'{layer.path}/{name}_norm') for name in names]
            check_layer(layer, sublayers, calls_under(layer.path, nn.Dropout), norms)

        (stack_output,) = [call.output for call in calls if call.path == stack]
        last = layers[-1].output
        if norm_placement == 'post':
            np.testing.assert_array_equal(stack_output, last, err_msg=stack)
        else:
            final_norm = params[stack]['final_norm']
            np.testing.assert_allclose(
                stack_output, layer_norm(last, final_norm), rtol=0, atol=layer_norm_atol(last, final_norm)
            )


def test_dropout_is_applied_to_the_embedding_sums_and_each_sublayer_output_and_nowhere_else():
    """Section 5.4: "We apply dropout to the output of each sub-layer ... In addition, we apply dropout to the
    sums of the embeddings and the positional encodings in both the encoder and decoder stacks", at rate P_drop.

    Every nn.Dropout in training mode takes, at config.dropout_rate, the tensor the step before it
    produced: the positional encoding's sum (once per stack) or a sub-layer's output (2 per encoder
    layer, 3 per decoder layer). With those dropouts made the identity and attention dropout (a
    separate rate, 0 in the paper's base model) off, training mode computes the deterministic
    logits: there is no other dropout.
    """
    config = dataclasses.replace(TINY, attention_dropout_rate=0.0)
    model, params = init(config)
    with recorded_calls(PositionalEncoding, MultiHeadAttention, FeedForward, nn.Dropout) as calls:
        apply(model, params, deterministic=False)
    producers, dropouts = calls[0::2], calls[1::2]
    assert len(dropouts) == 2 + 2 * config.num_encoder_layers + 3 * config.num_decoder_layers
    for producer, dropout in zip(producers, dropouts, strict=True):
        assert not isinstance(producer.module, nn.Dropout), f'{dropout.path} follows another dropout'
        assert isinstance(dropout.module, nn.Dropout), f'{producer.path} is not followed by dropout'
        assert dropout.module.rate == config.dropout_rate and dropout.kwargs['deterministic'] is False
        np.testing.assert_array_equal(dropout.args[0], producer.output, err_msg=f'{dropout.path} after {producer.path}')
    embedding_sums = [producer.path for producer in producers if isinstance(producer.module, PositionalEncoding)]
    assert embedding_sums == ['encoder/position_embedding', 'decoder/position_embedding']

    with recorded_calls(dropout_off=True):
        logits_without_dropout = apply(model, params, deterministic=False)
    np.testing.assert_array_equal(logits_without_dropout, apply(model, params, deterministic=True))


# --------------------------------------------------------------------------- #
# Label smoothing in the train step (section 5.4).
# --------------------------------------------------------------------------- #


def mean_kl_to_smoothed_targets(logits, targets, label_smoothing, xp=np):
    """Σ_v q_v (log q_v - log p_v) averaged over the real (non-pad) target tokens, with q the smoothed
    targets: 1 - ε on the true token, ε / (vocab - 1) on every other. `xp`: np, or jnp to differentiate."""
    true_token = np.arange(logits.shape[-1]) == np.asarray(targets)[..., None]
    soft = xp.where(true_token, 1.0 - label_smoothing, label_smoothing / (logits.shape[-1] - 1))
    q_log_q = xp.where(soft > 0, soft * xp.log(xp.where(soft > 0, soft, 1.0)), 0.0)  # 0 where q is.
    shifted = logits - logits.max(-1, keepdims=True)
    log_p = shifted - xp.log(xp.sum(xp.exp(shifted), axis=-1, keepdims=True))
    kl = xp.sum(q_log_q - soft * log_p, axis=-1)
    real = np.asarray(targets) != 0
    return xp.sum(xp.where(real, kl, 0.0)) / real.sum()


def test_label_smoothing_of_the_train_step_is_kl_to_the_smoothed_targets():
    """Section 5.4: "During training, we employed label smoothing of value ε_ls = 0.1."

    The train step (the task's loss, with config.optimizer.label_smoothing) minimizes the mean over
    target tokens of KL(q ‖ p), q the smoothed target distribution: its loss is that value, its
    gradient that of that value, and both change with ε. Dropout is off, so the loss is a function
    of the batch alone; the optimizer is optax.trace(decay=0), whose state after the step is
    exactly the gradient the step computed.
    """
    assert default.get_config().optimizer.label_smoothing == 0.1
    rng = np.random.default_rng(0)
    lengths = np.array([[6, 9], [3, 2], [8, 5], [1, 7]])  # Source, target lengths (pad 0 after).
    batch = {
        name: jnp.asarray(np.where(np.arange(10) < lengths[:, side, None], rng.integers(3, 24, (4, 10)), 0), jnp.int32)
        for side, name in enumerate(('inputs', 'targets'))
    }
    tokens = int(lengths[:, 1].sum())
    config = tiny_config()
    config.model.update(dropout_rate=0.0, attention_dropout_rate=0.0)
    model = make_model(config, vocab_size=24)
    tx = optax.trace(decay=0.0)
    params = random_params(model, batch['inputs'], batch['targets'])  # NumPy: no init to compile.
    state = TrainState(step=np.int32(0), params=params, opt_state=tx.init(params), rng=jax.random.PRNGKey(0))

    def logits_of(params):
        return model.apply({'params': params}, batch['inputs'], batch['targets'], deterministic=True)

    logits = f64(jax.jit(logits_of)(state.params))
    kl_gradient = jax.jit(
        jax.grad(lambda params, ε: mean_kl_to_smoothed_targets(logits_of(params), batch['targets'], ε, xp=jnp))
    )
    # The backward pass retraces the forward path and the log-softmax; a weight's gradient adds one term a token.
    operations = 2 * (transformer_operations(model.config, 10, 10) + model.config.vocab_size) + tokens
    gradients = {}
    for label_smoothing in (0.1, 0.0):
        config.optimizer.label_smoothing = label_smoothing
        loss_fn = TranslationTask().loss_fn(config, model)
        step = jax.jit(functools.partial(train_step, loss_fn=loss_fn, tx=tx, learning_rate_fn=lambda count: 0.0))
        new_state, metrics = step(state, batch, jax.random.key(1))

        expected_loss = mean_kl_to_smoothed_targets(logits, batch['targets'], label_smoothing)
        rtol = loss_rtol(model.config, length=10, tokens=tokens)
        np.testing.assert_allclose(metrics['loss'], expected_loss, rtol=rtol, err_msg=f'ε = {label_smoothing}')
        expected_gradient = kl_gradient(state.params, label_smoothing)
        for path, actual in jax.tree_util.tree_leaves_with_path(new_state.opt_state.trace):
            expected = subtree(expected_gradient, '/'.join(key.key for key in path))
            atol = rounding_tolerance(operations, np.abs(expected).max())
            np.testing.assert_allclose(actual, expected, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))
        gradients[label_smoothing] = new_state.opt_state.trace

    changes = jax.tree.map(lambda a, b: np.abs(a - b).max() / np.abs(b).max(), gradients[0.1], gradients[0.0])
    assert min(jax.tree.leaves(changes)) > 1e-2, changes  # Every weight's; far beyond the rounding allowed above.


# --------------------------------------------------------------------------- #
# The learning rate (section 5.3) and the base model's hyperparameters.
# --------------------------------------------------------------------------- #


def paper_learning_rate(step, d_model: int, warmup_steps: int, scale: float = 1.0):
    """lrate = d_model^-0.5 · min(step_num^-0.5, step_num · warmup_steps^-1.5), in float64 (times `scale`)."""
    step = np.asarray(step, np.float64)
    return scale * d_model**-0.5 * np.minimum(step**-0.5, step * warmup_steps**-1.5)


def paper_schedule_of(d_model: int, warmup_steps: int, scale: float = 1.0):
    """The schedule make_optimizer builds from configs/default.py with these values."""
    config = default.get_config()
    config.model.d_model = d_model
    config.optimizer.update(warmup_steps=warmup_steps, learning_rate_scale=scale)
    return make_optimizer(config.optimizer, d_model=config.model.d_model)[1]


# A few float32 roundings: step / warmup, the square root, the minimum, the product with the peak.
SCHEDULE_RTOL = rounding_tolerance(5)


@pytest.mark.parametrize('d_model', [256, 512])
@pytest.mark.parametrize('warmup_steps', [10, 4000])
def test_learning_rate_is_the_papers_formula(d_model, warmup_steps):
    """Section 5.3: "lrate = d_model^-0.5 · min(step_num^-0.5, step_num · warmup_steps^-1.5)", with
    learning_rate_scale (1 in the paper) multiplying it; step_num counts updates from 1."""
    steps = np.array(
        [1, 2, warmup_steps // 2, warmup_steps - 1, warmup_steps, warmup_steps + 1, 4 * warmup_steps, 10**5]
    )
    for scale in (1.0, 2.0):
        schedule = paper_schedule_of(d_model, warmup_steps, scale)
        # Optax hands the schedule the count of updates done: update n (from 1) sees count n - 1.
        np.testing.assert_allclose(
            schedule(steps - 1), paper_learning_rate(steps, d_model, warmup_steps, scale), rtol=SCHEDULE_RTOL
        )


@pytest.mark.parametrize('d_model, warmup_steps', [(512, 4000), (1024, 4000), (512, 16000), (64, 10)])
def test_learning_rate_peaks_at_warmup_steps_at_d_model_times_warmup_steps_to_the_minus_half(d_model, warmup_steps):
    """Section 5.3: "increasing the learning rate linearly for the first warmup_steps training steps, and
    decreasing it thereafter proportionally to the inverse square root of the step number": the peak is
    at step warmup_steps, (d_model · warmup_steps)^-0.5, so d_model and the warm-up move it as the formula says."""
    rates = np.asarray(paper_schedule_of(d_model, warmup_steps)(np.arange(3 * warmup_steps)))  # Steps 1 .. 3 w.
    assert int(np.argmax(rates)) + 1 == warmup_steps
    np.testing.assert_allclose(rates.max(), (d_model * warmup_steps) ** -0.5, rtol=SCHEDULE_RTOL)


def test_default_config_is_the_papers_base_model_and_training_schedule():
    """Table 3 (base) and sections 5.3, 5.4: N = 6, d_model = 512, d_ff = 2048, h = 8, P_drop = 0.1,
    ε_ls = 0.1, Adam β₁ = 0.9, β₂ = 0.98, ε = 10⁻⁹, warmup_steps = 4000 and the paper's learning rate,
    which peaks at 512^-0.5 · 4000^-0.5 ≈ 7.0e-4; sinusoidal positions, post-LN, shared embeddings."""
    config = default.get_config()
    model = config.model
    assert (model.num_layers, model.d_model, model.d_ff, model.num_heads) == (6, 512, 2048, 8)
    assert (model.num_encoder_layers, model.num_decoder_layers) == (-1, -1)  # Both take num_layers.
    assert (model.dropout_rate, model.attention_dropout_rate, config.optimizer.label_smoothing) == (0.1, 0.0, 0.1)
    assert (model.positional_encoding, model.norm_placement, model.tie_embeddings) == ('sinusoidal', 'post', True)
    optimizer = config.optimizer
    assert (optimizer.b1, optimizer.b2, optimizer.eps, optimizer.warmup_steps) == (0.9, 0.98, 1e-9, 4000)
    assert optimizer.schedule == 'paper' and optimizer.learning_rate_scale == 1.0

    tx, schedule = make_optimizer(optimizer, d_model=model.d_model)
    np.testing.assert_allclose(schedule(3999), 512**-0.5 * 4000**-0.5, rtol=SCHEDULE_RTOL)
    assert round(float(schedule(3999)), 5) == 7.0e-4
    # Adam's first updates are lr(step) · m̂ / (√v̂ + ε); with the same gradient g twice, m̂ = g and v̂ = g².
    gradient = {'w': jnp.asarray(np.random.default_rng(0).choice([-1.0, 1.0], 8) * np.linspace(0.5, 2.0, 8))}
    opt_state = tx.init(gradient)
    # Rounding β to float32 moves 1 - β^t by up to |β - float32(β)| / (1 - β) relatively (m̂ takes it
    # whole, √v̂ half); a dozen roundings in the moments and the quotient; ε / |g| is below 2e-9.
    beta_error = {beta: abs(float(np.float32(beta)) - beta) / (1 - beta) for beta in (optimizer.b1, optimizer.b2)}
    rtol = beta_error[optimizer.b1] + beta_error[optimizer.b2] / 2 + rounding_tolerance(12)
    for step in (1, 2):
        update, opt_state = tx.update(gradient, opt_state)
        expected = -paper_learning_rate(step, 512, 4000) * np.sign(gradient['w'])
        np.testing.assert_allclose(update['w'], expected, rtol=rtol, err_msg=f'update {step}')


def test_feed_forward_is_relu_between_two_linear_maps():
    """Section 3.3: "FFN(x) = max(0, x W₁ + b₁) W₂ + b₂", applied to each position separately and identically."""
    ffn = FeedForward(d_ff=TINY.d_ff)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, TINY.d_model)), jnp.float32)
    params = nn.unbox(ffn.init(jax.random.key(0), x)['params'])
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)  # Biases too.
    w1, b1 = f64(params['hidden']['kernel']), f64(params['hidden']['bias'])
    w2, b2 = f64(params['output']['kernel']), f64(params['output']['bias'])
    hidden = np.maximum(0.0, f64(x) @ w1 + b1)
    expected = hidden @ w2 + b2
    # The hidden units sum d_model products and a bias; their error, through the ReLU, reaches an
    # output through a column of W₂, which adds its own sum of d_ff products and a bias.
    hidden_atol = rounding_tolerance(TINY.d_model + 1, (np.abs(f64(x)) @ np.abs(w1) + np.abs(b1)).max())
    atol = hidden_atol * np.abs(w2).sum(0).max() + rounding_tolerance(
        TINY.d_ff + 1, (np.abs(hidden) @ np.abs(w2) + np.abs(b2)).max()
    )
    np.testing.assert_allclose(ffn.apply({'params': params}, x), expected, rtol=0, atol=atol)

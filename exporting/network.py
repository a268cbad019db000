"""A trained Transformer's weights as plain float32 arrays, laid out for other engines to read.

Every matrix is stored as this project applies it, `y = x @ W` ([inputs, outputs]); the
per-head query, key and value kernels [d_model, heads, d] are flattened to [d_model, heads * d]
(head-major, as every engine splits them), and the output kernel to [heads * d_v, d_model].
Positions added to the embeddings are an explicit table: the sinusoids of
`models.embeddings.sinusoidal_positions` (interleaved sin/cos) or the learned table. Relative
positions are each self-attention's tables; rotary ones have no weights (the config says them).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from models.config import TransformerConfig
from models.embeddings import sinusoidal_positions


@dataclasses.dataclass(frozen=True)
class Norm:
    """A LayerNorm's scale and bias, [d_model] each."""

    scale: np.ndarray
    bias: np.ndarray


@dataclasses.dataclass(frozen=True)
class Attention:
    """One multi-head attention; no biases (as in the paper)."""

    query: np.ndarray  # [d_model, heads * d_k]
    key: np.ndarray  # [d_model, heads * d_k]
    value: np.ndarray  # [d_model, heads * d_v]
    output: np.ndarray  # [heads * d_v, d_model]
    # 'relative' self-attention (Shaw et al.): a^K [2 * clip + 1, d_k] and a^V [2 * clip + 1, d_v] (zeros
    # where only the keys have them), shared by the heads, indexed by clip(j - i, -clip, clip) + clip.
    relative_keys: np.ndarray | None = None
    relative_values: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class FeedForward:
    """max(0, x W_1 + b_1) W_2 + b_2."""

    hidden: np.ndarray  # W_1 [d_model, d_ff]
    hidden_bias: np.ndarray  # b_1 [d_ff]
    output: np.ndarray  # W_2 [d_ff, d_model]
    output_bias: np.ndarray  # b_2 [d_model]


@dataclasses.dataclass(frozen=True)
class Layer:
    """An encoder layer (no cross-attention) or a decoder layer, each sub-layer with its LayerNorm."""

    self_attention: Attention
    self_attention_norm: Norm
    feed_forward: FeedForward
    feed_forward_norm: Norm
    cross_attention: Attention | None = None
    cross_attention_norm: Norm | None = None


@dataclasses.dataclass(frozen=True)
class Stack:
    """The encoder or the decoder: embeddings, positions, layers and (pre-LN) the final LayerNorm."""

    embedding: np.ndarray  # [vocab, d_model], multiplied by sqrt(d_model) when looked up.
    positions: np.ndarray | None  # [max_len, d_model], added after the scaled embeddings; None: in attention.
    layers: tuple[Layer, ...]
    final_norm: Norm | None  # Pre-LN only.


@dataclasses.dataclass(frozen=True)
class Network:
    """The whole encoder-decoder, and what an engine needs to know to run it as this project does."""

    config: TransformerConfig
    encoder: Stack
    decoder: Stack
    output_projection: np.ndarray  # [vocab, d_model]: logits = hidden @ output_projection.T (tied: the embedding).

    @property
    def pre_norm(self) -> bool:
        """Whether the sub-layers are x + sublayer(LN(x)) (else LN(x + sublayer(x)), the paper's)."""
        return self.config.norm_placement == "pre"


def _array(tree: Mapping[str, Any], *path: str) -> np.ndarray:
    for name in path:
        tree = tree[name]
    return np.array(tree, dtype=np.float32)  # A writable host copy: engines quantize in place.


def _norm(tree: Mapping[str, Any]) -> Norm:
    return Norm(_array(tree, "scale"), _array(tree, "bias"))


def _attention(tree: Mapping[str, Any]) -> Attention:
    def flat_in(name):  # [d_model, heads, d] -> [d_model, heads * d]
        kernel = _array(tree, name, "kernel")
        return kernel.reshape(kernel.shape[0], -1)

    output = _array(tree, "output", "kernel")  # [heads, d_v, d_model]
    relative = {}
    if "relative_positions" in tree:
        keys = _array(tree, "relative_positions", "key")
        values = tree["relative_positions"].get("value")
        relative = {
            "relative_keys": keys,
            "relative_values": np.zeros((keys.shape[0], output.shape[1]), np.float32)
            if values is None
            else np.array(values, np.float32),
        }
    return Attention(
        flat_in("query"), flat_in("key"), flat_in("value"), output.reshape(-1, output.shape[-1]), **relative
    )


def _feed_forward(tree: Mapping[str, Any]) -> FeedForward:
    return FeedForward(
        _array(tree, "hidden", "kernel"),
        _array(tree, "hidden", "bias"),
        _array(tree, "output", "kernel"),
        _array(tree, "output", "bias"),
    )


def _layer(tree: Mapping[str, Any], *, decoder: bool) -> Layer:
    cross = (
        {
            "cross_attention": _attention(tree["cross_attention"]),
            "cross_attention_norm": _norm(tree["cross_attention_norm"]),
        }
        if decoder
        else {}
    )
    return Layer(
        self_attention=_attention(tree["self_attention"]),
        self_attention_norm=_norm(tree["self_attention_norm"]),
        feed_forward=_feed_forward(tree["feed_forward"]),
        feed_forward_norm=_norm(tree["feed_forward_norm"]),
        **cross,
    )


def _positions(config: TransformerConfig, stack: Mapping[str, Any]) -> np.ndarray | None:
    if config.positional_encoding == "learned":
        return _array(stack, "position_embedding", "embedding")
    if config.positional_encoding == "sinusoidal":
        return sinusoidal_positions(config.max_len, config.d_model)
    if config.positional_encoding in ("relative", "rotary"):
        return None  # Inside self-attention: `Attention.relative_keys`, or rotated queries and keys.
    raise ValueError(f"No positions table for {config.positional_encoding!r} positions.")


def network_from_params(config: TransformerConfig, params: Mapping[str, Any]) -> Network:
    """The weights of a `models.Transformer`, as host arrays.

    Args:
        config: the model's config.
        params: its parameter tree (the 'params' collection, unboxed; device arrays are fetched).
    """
    if config.tie_embeddings:
        source = target = projection = _array(params, "shared_embedding", "embedding")
    else:
        source = _array(params, "source_embedding", "embedding")
        target = _array(params, "target_embedding", "embedding")
        projection = _array(params, "output_projection", "kernel").T  # Dense kernel [d_model, vocab].
    pre = config.norm_placement == "pre"

    def stack(name: str, embedding: np.ndarray, count: int) -> Stack:
        tree = params[name]
        return Stack(
            embedding=embedding,
            positions=_positions(config, tree),
            layers=tuple(_layer(tree[f"layers_{i}"], decoder=name == "decoder") for i in range(count)),
            final_norm=_norm(tree["final_norm"]) if pre else None,
        )

    return Network(
        config=config,
        encoder=stack("encoder", source, config.num_encoder_layers),
        decoder=stack("decoder", target, config.num_decoder_layers),
        output_projection=projection,
    )


def _norm_reordered(norm: Norm | None, order: np.ndarray) -> Norm | None:
    return None if norm is None else Norm(norm.scale[order], norm.bias[order])


def _attention_reordered(attention: Attention | None, order: np.ndarray) -> Attention | None:
    if attention is None:
        return None
    return dataclasses.replace(
        attention,
        query=attention.query[order],
        key=attention.key[order],
        value=attention.value[order],
        output=attention.output[:, order],
    )


def _layer_reordered(layer: Layer, order: np.ndarray) -> Layer:
    ff = layer.feed_forward
    return Layer(
        self_attention=_attention_reordered(layer.self_attention, order),
        self_attention_norm=_norm_reordered(layer.self_attention_norm, order),
        feed_forward=FeedForward(ff.hidden[order], ff.hidden_bias, ff.output[:, order], ff.output_bias[order]),
        feed_forward_norm=_norm_reordered(layer.feed_forward_norm, order),
        cross_attention=_attention_reordered(layer.cross_attention, order),
        cross_attention_norm=_norm_reordered(layer.cross_attention_norm, order),
    )


def reordered(network: Network, order: np.ndarray) -> Network:
    """The same function with the d_model units of every hidden state reordered: unit i becomes unit order[i].

    Every vector the model dimension indexes is permuted alike, and LayerNorm, attention and
    the feed-forward layers are equivariant to that: the logits do not change, bit for bit
    apart from the order of the sums.

    Args:
        network: the weights.
        order: [d_model] a permutation of 0 .. d_model - 1.
    """

    def stack(s: Stack) -> Stack:
        return Stack(
            embedding=s.embedding[:, order],
            positions=s.positions[:, order],
            layers=tuple(_layer_reordered(layer, order) for layer in s.layers),
            final_norm=_norm_reordered(s.final_norm, order),
        )

    return dataclasses.replace(
        network,
        encoder=stack(network.encoder),
        decoder=stack(network.decoder),
        output_projection=network.output_projection[:, order],
    )


def sin_then_cos_order(d_model: int) -> np.ndarray:
    """The order that moves interleaved sinusoids (sin, cos, sin, cos, ...) to sines first, then cosines.

    `sinusoidal_positions(n, d)[:, sin_then_cos_order(d)]` is the table of engines that lay the
    paper's sinusoids out in halves (fairseq, Marian): sin(pos / 10000^(2i/d)) at unit i and the
    matching cos at unit d/2 + i.
    """
    return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])

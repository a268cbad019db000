"""Tests for training/reporting/attention_maps.py: collecting attention weights, drawing them, writing them out."""

import dataclasses
import os

import jax
import matplotlib.image
import numpy as np
import pytest
from conftest import TINY_MODEL, bundled_tokenizer, random_params, read_events
from matplotlib.figure import Figure

from common.errors import UserInputError
from common.special_ids import EOS_ID, PAD_ID
from models import Transformer
from training.reporting import attention_maps, attention_weights
from training.reporting.metrics_writer import MetricWriter

# Different layer counts (and sentence lengths), so that a swapped stack or axis changes a shape.
CONFIG = dataclasses.replace(TINY_MODEL, vocab_size=200, num_encoder_layers=1, num_decoder_layers=2, max_len=24)
SOURCE_TEXT, TARGET_TEXT = "Click the button.", "Klicken Sie auf OK."
NAMES = [
    "encoder/layer_0/self_attention",
    "decoder/layer_0/self_attention",
    "decoder/layer_0/cross_attention",
    "decoder/layer_1/self_attention",
    "decoder/layer_1/cross_attention",
]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return bundled_tokenizer(str(tmp_path_factory.mktemp("tokenizer") / "tokenizer.model"), CONFIG.vocab_size)


@pytest.fixture(scope="module")
def pair(tokenizer):
    """Source and target ids (ending with eos) and their pieces."""
    source, target = (np.array(tokenizer.encode(text) + [EOS_ID], np.int32) for text in (SOURCE_TEXT, TARGET_TEXT))
    assert len(source) != len(target)
    source_pieces, target_pieces = (attention_weights.token_pieces(tokenizer, ids) for ids in (source, target))
    return source, target, source_pieces, target_pieces


@pytest.fixture(scope="module")
def model_and_params(pair):
    """The model and random numpy parameters of its shapes (Flax's eager `init` would cost seconds of compiles)."""
    source, target, *_ = pair
    model = Transformer(CONFIG)
    return model, random_params(model, source[None], target[None])


@pytest.fixture(scope="module")
def weights(model_and_params, pair):
    source, target, *_ = pair
    return attention_weights.attention_weights(*model_and_params, source, target)


@pytest.fixture(scope="module")
def attention(weights, pair):
    *_, source_pieces, target_pieces = pair
    return attention_weights.SentenceAttention(weights, source_pieces, target_pieces)


@pytest.fixture(scope="module")
def figures(attention):
    return attention_maps.attention_figures(attention)


# --- Collecting the weights ---------------------------------------------------------------------------


def test_weights_cover_every_layer_and_kind_with_query_by_key_shapes(weights, pair):
    source, target, *_ = pair
    assert list(weights) == NAMES
    heads, src, tgt = CONFIG.num_heads, len(source), len(target)
    expected_shapes = {"encoder": (heads, src, src), "self": (heads, tgt, tgt), "cross": (heads, tgt, src)}
    for name, w in weights.items():
        kind = "encoder" if name.startswith("encoder") else name.split("/")[2].split("_")[0]
        assert w.shape == expected_shapes[kind], name
        assert w.dtype == np.float32
        np.testing.assert_allclose(w.sum(axis=-1), 1.0, rtol=1e-5, err_msg=name)


def test_decoder_self_attention_is_causal(weights):
    for layer in range(CONFIG.num_decoder_layers):
        w = weights[f"decoder/layer_{layer}/self_attention"]
        assert np.all(np.triu(w, k=1) == 0.0)  # No query sees a later position...
        assert np.all(w[:, np.tril(np.ones(w.shape[1:], bool))] > 0.0)  # ...and untrained, sees every earlier one.
    # Without padding, encoder self-attention and cross-attention mask nothing.
    unmasked = [w for name, w in weights.items() if not name.startswith("decoder") or "cross" in name]
    assert len(unmasked) == CONFIG.num_encoder_layers + CONFIG.num_decoder_layers
    assert all(np.all(w > 0.0) for w in unmasked)


def test_heads_are_kept_apart(weights):
    encoder = weights["encoder/layer_0/self_attention"]
    assert np.abs(encoder[0] - encoder[1]).max() > 1e-3  # Per head, not an average over heads.


def test_padding_is_dropped_and_does_not_change_the_weights(model_and_params, pair, weights):
    source, target, *_ = pair
    padded = attention_weights.attention_weights(
        *model_and_params, np.pad(source, (0, 5), constant_values=PAD_ID), np.pad(target, (0, 3))
    )
    assert padded.keys() == weights.keys()
    for name in weights:
        np.testing.assert_array_equal(padded[name], weights[name], err_msg=name)


def test_the_pass_is_deterministic_despite_dropout_in_the_config(model_and_params, pair, weights):
    assert CONFIG.dropout_rate > 0 and CONFIG.attention_dropout_rate > 0
    again = attention_weights.attention_weights(*model_and_params, *pair[:2])
    for name in weights:
        np.testing.assert_array_equal(again[name], weights[name])


def test_each_name_holds_its_own_layer(model_and_params, pair, weights):
    """Negating decoder layer 1's cross-attention queries changes that map and none computed before it."""
    model, params = model_and_params
    query = ("decoder", "layers_1", "cross_attention", "query", "kernel")
    changed = jax.tree_util.tree_map_with_path(lambda path, p: -p if tuple(k.key for k in path) == query else p, params)
    after = attention_weights.attention_weights(model, changed, *pair[:2])
    for name in NAMES[:-1]:
        np.testing.assert_array_equal(after[name], weights[name], err_msg=name)
    assert not np.allclose(after[NAMES[-1]], weights[NAMES[-1]])


def test_a_sentence_longer_than_the_model_allows_is_a_user_error(model_and_params, pair):
    too_long = np.full(CONFIG.max_len + 1, 5, np.int32)
    with pytest.raises(UserInputError, match=rf"source sentence has {CONFIG.max_len + 1} subword tokens"):
        attention_weights.attention_weights(*model_and_params, too_long, pair[1])


def test_token_pieces_are_the_subwords_without_padding(tokenizer, pair):
    source, *_ = pair
    pieces = attention_weights.token_pieces(tokenizer, np.pad(source, (0, 4), constant_values=PAD_ID))
    assert pieces == [*tokenizer.encode(SOURCE_TEXT, out_type=str), "</s>"]


# --- Drawing ------------------------------------------------------------------------------------------


def heatmap_axes(figure: Figure):
    return [ax for ax in figure.axes if ax.images and ax.get_title().startswith("head")]


def tick_texts(labels) -> list[str]:
    return [label.get_text() for label in labels]


def test_every_head_is_a_panel_labelled_with_its_tokens(weights, figures, pair):
    *_, source_pieces, target_pieces = pair
    assert list(figures) == NAMES
    expected_labels = {  # kind -> (row labels, column labels)
        "encoder": (source_pieces, source_pieces),
        "self_attention": (target_pieces, ["<s>", *target_pieces[:-1]]),
        "cross_attention": (target_pieces, source_pieces),
    }
    for name, figure in figures.items():
        kind = "encoder" if name.startswith("encoder") else name.split("/")[2]
        rows, columns = expected_labels[kind]
        panels = heatmap_axes(figure)
        assert [ax.get_title() for ax in panels] == [f"head {h}" for h in range(CONFIG.num_heads)]
        for head, ax in enumerate(panels):
            assert tick_texts(ax.get_yticklabels()) == rows, name
            assert tick_texts(ax.get_xticklabels()) == columns, name
            np.testing.assert_array_equal(ax.images[0].get_array(), weights[name][head])
        assert len(figure.axes) == CONFIG.num_heads + 1  # The heads and one shared colour bar.
        assert all(ax.images[0].norm is panels[0].images[0].norm for ax in panels)
    assert figures["decoder/layer_1/cross_attention"].get_suptitle() == "Decoder layer 1: cross-attention"
    assert_readable(figures["decoder/layer_1/cross_attention"])


def assert_readable(figure: Figure) -> None:
    """Every tick label lies inside the figure and clear of its neighbours and of other panels."""
    renderer = figure.canvas.get_renderer()
    figure.draw(renderer)
    for ax in heatmap_axes(figure):
        others = [other.get_window_extent(renderer) for other in figure.axes if other is not ax]
        for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            boxes = [label.get_window_extent(renderer) for label in labels]
            for box in boxes:
                assert figure.bbox.x0 <= box.x0 and box.x1 <= figure.bbox.x1
                assert figure.bbox.y0 <= box.y0 and box.y1 <= figure.bbox.y1
                assert not any(box.overlaps(other) for other in others)
            assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:]))


def test_labels_stay_readable_for_short_and_long_sentences():
    rng = np.random.default_rng(0)
    name = "decoder/layer_0/cross_attention"
    sizes = {}
    for length in (2, 20, 60):
        weights = rng.dirichlet(np.ones(length), size=(2, length)).astype(np.float32)
        pieces = [f"▁piece{i}" for i in range(length)]
        figure = attention_maps.attention_figure(weights, pieces, pieces, name)
        assert_readable(figure)
        panel = heatmap_axes(figure)[0]
        sizes[length] = (panel.get_window_extent().width / figure.dpi, panel.get_xticklabels()[0].get_fontsize())
    # Up to READABLE_TOKENS the panel grows with the sentence; beyond it, cells and labels shrink.
    readable, cell = attention_maps.READABLE_TOKENS, attention_maps._CELL_INCHES
    assert sizes[20][0] == pytest.approx(20 * cell)
    assert sizes[60][0] == pytest.approx(readable * cell)
    assert sizes[60][1] == pytest.approx(sizes[20][1] * readable / 60)
    assert sizes[2][0] == pytest.approx(attention_maps._MIN_PANEL_INCHES)


def test_pieces_must_match_the_weights(weights, pair):
    *_, source_pieces, target_pieces = pair
    with pytest.raises(ValueError, match=rf"but there are {len(source_pieces) - 1} query and"):
        attention_maps.attention_figures(
            attention_weights.SentenceAttention(weights, source_pieces[:-1], target_pieces)
        )


# --- Writing ------------------------------------------------------------------------------------------


def test_save_writes_one_png_per_map(figures, tmp_path):
    paths = attention_maps.save_attention_maps(figures, str(tmp_path / "maps"))
    assert len(paths) == CONFIG.num_encoder_layers + 2 * CONFIG.num_decoder_layers
    assert sorted(os.listdir(tmp_path / "maps")) == sorted(os.path.basename(p) for p in paths)
    assert os.path.basename(paths[0]) == "encoder_layer0_self_attention.png"
    assert os.path.basename(paths[-1]) == "decoder_layer1_cross_attention.png"
    for path, figure in zip(paths, figures.values()):
        with open(path, "rb") as f:
            assert f.read(8) == PNG_SIGNATURE
        height, width, _ = matplotlib.image.imread(path).shape  # Decodes the whole image.
        assert (width, height) == tuple(round(x) for x in figure.get_size_inches() * figure.dpi)


def test_tensorboard_gets_one_image_per_map(figures, tmp_path):
    writer = MetricWriter(str(tmp_path), "eval")
    attention_maps.write_attention_summaries(writer, 7, figures)
    writer.close()
    images = {
        value.tag: (event.step, value.image)
        for event in read_events(str(tmp_path / "tensorboard" / "eval"))
        for value in event.summary.value
    }
    assert set(images) == {f"attention/{name}" for name in NAMES}
    for name, figure in figures.items():
        step, image = images[f"attention/{name}"]
        assert step == 7
        assert image.encoded_image_string.startswith(PNG_SIGNATURE)
        width, height = (round(x) for x in figure.get_size_inches() * figure.dpi)
        assert (image.width, image.height) == (width, height)

"""Tests for training/reporting/attention_page.py: the page embeds the model's weights, and a real browser shows them.

The browser tests drive Debian's `chromium` headless through `chromium-driver` (Selenium). Where they are
not installed the tests are skipped, unless AIAYN_REQUIRE_BROWSER=1 (as `.ci/run` sets it): then they fail.
"""

import dataclasses
import html
import os
import shutil

import numpy as np
import pytest
from conftest import TINY_MODEL, bundled_tokenizer, random_params

from benchmarks.page_browser import choose, click_piece, console_errors, open_chromium, open_page, wait_until_drawn
from common.special_ids import EOS_ID
from models import Transformer
from training.reporting import attention_page, attention_weights
from training.reporting.attention_page import LEVELS, PageSentence

# Layers of both stacks and four heads, so that a swapped layer or head changes the weights shown.
CONFIG = dataclasses.replace(TINY_MODEL, vocab_size=200, num_encoder_layers=1, num_decoder_layers=2, max_len=24)
PAIRS = [
    ("Click the button.", "Klicken Sie auf OK."),
    ("Select the cells that you want to delete.", "Wählen Sie die Zellen aus."),
]
# A stored weight is within half a level of the model's; the page prints it with 3 decimals.
STORED = 0.5 / LEVELS
PRINTED = 0.0005


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    tokenizer = bundled_tokenizer(str(tmp_path_factory.mktemp("tokenizer") / "tokenizer.model"), CONFIG.vocab_size)
    model = Transformer(CONFIG)
    ids = np.array([tokenizer.encode(PAIRS[0][0]) + [EOS_ID]], np.int32)
    # Parameters large enough for peaked attention (at 0.1 the cross-attention is uniform): a transposed
    # map or a swapped head then shows.
    return model, random_params(model, ids, ids, scale=0.5), tokenizer


@pytest.fixture(scope="module")
def sentences(model_and_tokenizer):
    """The two pairs' attention, teacher-forced, as translate.py collects it."""
    sentences = [
        PageSentence(
            f"line {i}",
            source,
            target,
            origin,
            attention_weights.sentence_attention(*model_and_tokenizer, source, target),
        )
        for i, ((source, target), origin) in enumerate(zip(PAIRS, ("given", "translation")), start=1)
    ]
    for weights in sentences[0].attention.weights.values():
        assert np.all(weights.max(axis=(1, 2)) > 2 / weights.shape[2]), "every head peaked, none uniform"
    return sentences


@pytest.fixture(scope="module")
def page(sentences, tmp_path_factory) -> str:
    return attention_page.write_attention_page(sentences, str(tmp_path_factory.mktemp("page") / "index.html"), "Test")


# --- The embedded data ------------------------------------------------------------------------------


def test_the_page_embeds_every_map_of_the_model_within_half_a_level(sentences, page):
    embedded = attention_page.read_attention_page(page)
    assert [s["name"] for s in embedded] == ["line 1", "line 2"]
    for sentence, read in zip(sentences, embedded, strict=True):
        attention = sentence.attention
        assert (read["source"], read["target"], read["target_origin"]) == (
            sentence.source,
            sentence.target,
            sentence.target_origin,
        )
        assert read["pieces"] == {seq: attention.pieces(seq) for seq in ("source", "target", "decoder_input")}
        assert list(read["weights"]) == list(attention.weights)  # Every layer and kind, in the model's order.
        for name, weights in attention.weights.items():
            entry = next(m for m in read["maps"] if m["name"] == name)
            queries, keys = attention_weights.map_axes(name)
            assert (entry["queries"], entry["keys"]) == (queries, keys)
            assert weights.shape == (CONFIG.num_heads, len(attention.pieces(queries)), len(attention.pieces(keys)))
            # The model's rows are distributions over the keys a query may see: all of them, or, in the
            # decoder's self-attention, itself and the positions before it.
            causal = name.startswith("decoder") and name.endswith("self_attention")
            visible = np.tril(np.ones(weights.shape[1:], bool)) if causal else True
            np.testing.assert_allclose(np.where(visible, weights, 0).sum(-1), 1.0, rtol=1e-5, err_msg=name)
            if visible is not True:
                assert np.all(weights[:, ~visible] == 0.0), name
            np.testing.assert_allclose(read["weights"][name], weights, rtol=0, atol=STORED + 1e-7, err_msg=name)
            # Rounded, a row of n keys still sums to 1 within n half-levels.
            assert np.all(np.abs(read["weights"][name].sum(-1) - 1) <= weights.shape[-1] * STORED + 1e-6), name


def test_pieces_such_as_the_end_of_sentence_cannot_end_the_pages_script(sentences, page):
    assert "</s>" in sentences[0].attention.source_pieces
    text = open(page, encoding="utf-8").read()
    data = text[text.index('id="attention-data">') : text.index("</script>", text.index('id="attention-data">'))]
    assert "</" not in data and "\\u003c/s>" in data
    assert text.count("<script") == text.count("</script>") == 2  # The data and the program, nothing fetched.
    assert "src=" not in text and "http" not in text.replace("http://www.w3.org/2000/svg", "")


def test_texts_and_titles_that_look_like_markup_stay_text(sentences, tmp_path):
    hostile = "</script><!-- <b>&amp; /*ATTENTION_DATA*/null <!--TITLE-->"
    sentence = dataclasses.replace(sentences[0], name=hostile, source=hostile, target=hostile)
    path = attention_page.write_attention_page([sentence], str(tmp_path / "page.html"), title=hostile)
    text = open(path, encoding="utf-8").read()
    assert text.count("<script") == text.count("</script>") == 2 and text.count("<!--") == 1  # The template's own.
    (read,) = attention_page.read_attention_page(path)
    assert (read["name"], read["source"], read["target"]) == (hostile,) * 3
    assert f"<title>{html.escape(hostile)}</title>" in text


def test_weights_that_do_not_fit_their_pieces_are_refused(sentences, tmp_path):
    attention = sentences[0].attention
    cut = attention_weights.SentenceAttention(attention.weights, attention.source_pieces[:-1], attention.target_pieces)
    with pytest.raises(ValueError, match=r"encoder/layer_0/self_attention: weights \(4, \d+, \d+\) do not match"):
        attention_page.attention_page([dataclasses.replace(sentences[0], attention=cut)])


def test_twenty_sentences_of_64_pieces_fit_in_three_megabytes():
    """The quick-start model's shapes (2 + 2 layers, 4 heads), with weights that deflate worst: random ones.

    Uncompressed, a sentence is 3 x 2 x 4 x 64^2 = 98,304 bytes, 131,072 in base64: 2.6 MB for 20.
    """
    rng = np.random.default_rng(0)
    pieces = [f"▁piece{i}" for i in range(63)] + ["</s>"]
    names = ["encoder/layer_0/self_attention", "encoder/layer_1/self_attention"]
    names += [f"decoder/layer_{i}/{kind}" for i in (0, 1) for kind in ("self_attention", "cross_attention")]
    weights = {name: rng.dirichlet(np.ones(64), size=(4, 64)).astype(np.float32) for name in names}
    sentence = PageSentence(
        "line 1", "source", "target", "translation", attention_weights.SentenceAttention(weights, pieces, pieces)
    )
    one, twenty = (len(attention_page.attention_page([sentence] * n).encode()) for n in (1, 20))
    assert twenty - one == 19 * (len(attention_page.attention_page([sentence] * 2).encode()) - one)
    assert (twenty - one) / 19 <= 3 * 2 * 4 * 64**2 * 4 / 3 + 2000  # The weights, and the pieces as JSON.
    assert twenty < 3_000_000


# --- In a browser ------------------------------------------------------------------------------------


def _browser_or_skip():
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        chromium = None
    if chromium and driver:
        return chromium, driver
    message = "needs Debian's chromium and chromium-driver, and selenium (the test extra)"
    if os.environ.get("AIAYN_REQUIRE_BROWSER") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser():
    chromium, driver = _browser_or_skip()
    chrome = open_chromium(chromium, driver)
    yield chrome
    chrome.quit()


def shown_weights(elements) -> dict[tuple[int, int], float]:
    return {
        (int(e.get_attribute("data-q")), int(e.get_attribute("data-k"))): float(e.get_attribute("data-w"))
        for e in elements
    }


def assert_shown(shown: dict, weights: np.ndarray, cells: list[tuple[int, int]]) -> None:
    """The page shows the model's weights [q_len, kv_len] at exactly `cells`, to the rounding."""
    assert sorted(shown) == sorted(cells)
    for (q, k), w in shown.items():
        assert abs(w - weights[q, k]) <= STORED + PRINTED + 1e-6, (q, k, w, weights[q, k])


@pytest.mark.slow
def test_the_page_loads_in_a_browser_and_highlights_the_models_weights(browser, sentences, page, tmp_path):
    open_page(browser, page)
    assert console_errors(browser) == []
    attention = sentences[0].attention
    texts = browser.find_element("id", "texts").text
    assert PAIRS[0][0] in texts and PAIRS[0][1] in texts and "given" in texts

    # Cross-attention, layer 1, head 2, heat map: a target piece's row is where it attends.
    cross = attention.weights["decoder/layer_1/cross_attention"][2]
    choose(browser, "decoder/cross_attention", 1, "2", "heatmap")
    click_piece(browser, "target", 3)
    keys = cross.shape[1]
    assert_shown(
        shown_weights(browser.find_elements("css selector", ".cell.row")), cross, [(3, k) for k in range(keys)]
    )
    assert browser.find_elements("css selector", ".cell.col") == []  # A target piece is no key of cross-attention.
    listed = browser.find_elements("css selector", "#details .row-weights tr")
    assert len(listed) == np.count_nonzero(np.rint(cross[3] * LEVELS))
    for row in listed:
        k, w = (
            int(row.get_attribute("data-index")),
            float(row.find_element("css selector", "td.w").get_attribute("data-w")),
        )
        assert abs(w - cross[3, k]) <= STORED + PRINTED + 1e-6

    # A source piece's column: what attends to it.
    click_piece(browser, "source", 1)
    queries = cross.shape[0]
    assert_shown(
        shown_weights(browser.find_elements("css selector", ".cell.col")), cross, [(q, 1) for q in range(queries)]
    )

    # Decoder self-attention (square: a transposed map would show), lines view, head 1: the piece's lines.
    self_attention = attention.weights["decoder/layer_0/self_attention"][1]
    choose(browser, "decoder/self_attention", 0, "1", "lines")
    click_piece(browser, "target", 2)
    lines = browser.find_elements("css selector", "line.picked")
    assert {e.get_attribute("data-h") for e in lines} == {"1"}
    stored = np.rint(self_attention * LEVELS) > 0  # Weights stored as 0 draw no line, and are counted apart.
    zeros = len(stored[2]) - np.count_nonzero(stored[2])
    assert f"{zeros} keys below 0.002 (stored as 0)" in browser.find_element("id", "details").text
    assert console_errors(browser) == []
    assert_shown(shown_weights(lines), self_attention, [(2, k) for k in range(len(stored[2])) if stored[2, k]])

    # All heads: one colour each, and the other sentence.
    choose(browser, "encoder/self_attention", 0, "all", "heatmap")
    swatches = browser.find_elements("css selector", "#legend .swatch")
    assert len({swatch.value_of_css_property("background-color") for swatch in swatches}) == CONFIG.num_heads
    from selenium.webdriver.support.ui import Select  # pylint: disable=import-outside-toplevel

    Select(browser.find_element("id", "sentence")).select_by_value("1")
    wait_until_drawn(browser, "1/encoder/self_attention/0/all/heatmap")
    assert PAIRS[1][0] in browser.find_element("id", "texts").text
    choose(browser, "encoder/self_attention", 0, "3", "heatmap", sentence=1)
    click_piece(browser, "source", 0)
    encoder = sentences[1].attention.weights["encoder/layer_0/self_attention"][3]
    assert_shown(
        shown_weights(browser.find_elements("css selector", ".cell.row")),
        encoder,
        [(0, k) for k in range(encoder.shape[1])],
    )
    assert console_errors(browser) == []
    screenshot = tmp_path / "page.png"
    assert browser.save_screenshot(str(screenshot)) and screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_classifiers_page_of_one_piece_shows_its_encoder_alone(browser, tmp_path):
    weights = {"encoder/layer_0/self_attention": np.ones((2, 1, 1), np.float32)}
    attention = attention_weights.SentenceAttention(weights, ["</s>"], [])
    page = attention_page.write_attention_page(
        [PageSentence("line 1", "", "", "", attention)], str(tmp_path / "p.html")
    )
    open_page(browser, page)
    kinds = browser.find_elements("css selector", 'input[name="kind"]')
    assert [kind.get_attribute("value") for kind in kinds] == ["encoder/self_attention"]
    click_piece(browser, "source", 0)
    assert_shown(
        shown_weights(browser.find_elements("css selector", ".cell.row")),
        weights["encoder/layer_0/self_attention"][0],
        [(0, 0)],
    )
    assert console_errors(browser) == []


@pytest.mark.slow
def test_a_page_whose_script_fails_fails_in_the_browser(browser, sentences, tmp_path):
    """The console is read: a page whose data cannot be inflated reports an error there (and on the page)."""
    path = tmp_path / "broken.html"
    text = attention_page.attention_page(sentences[:1])
    weights = text[text.index('"weights":"') + len('"weights":"') :].split('"', 1)[0]
    path.write_text(text.replace(weights, "AAAA" + weights[4:]), encoding="utf-8")
    browser.get(path.as_uri())
    from selenium.webdriver.support.ui import WebDriverWait  # pylint: disable=import-outside-toplevel

    WebDriverWait(browser, 10).until(lambda driver: driver.find_elements("css selector", "#map .error"))
    assert any("Uncaught" in message or "Error" in message for message in console_errors(browser))

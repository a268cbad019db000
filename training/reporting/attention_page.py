"""Attention as one self-contained, interactive HTML page: every sentence, layer, head and piece, in a browser.

`write_attention_page` embeds the weights of a list of `SentenceAttention` (attention_weights.py) as
JSON in `attention_page.html`, a page with its script and style inline: it needs no network and no
server (it opens from file://). On it: a sentence selector; encoder self-, decoder self- or
cross-attention, a layer and a head (or all heads, each its own colour); a heat map or lines view;
pointing at a piece highlights where it attends (its row) and what attends to it (its column), with
the weights listed.

Size: each weight is rounded to a multiple of 1/255 and stored as one byte, a sentence's maps
deflated together (zlib) and base64-encoded. Uncompressed, a sentence of n pieces both sides costs
3 x layers x heads x n^2 bytes before base64's 4/3: 98 KB at n = 64 for the quick-start model
(2 + 2 layers, 4 heads). `read_attention_page` reads the weights back, as the page decodes them.
"""

import base64
import dataclasses
import html
import json
import os
import zlib
from collections.abc import Sequence
from importlib import resources

import numpy as np

from common import io_errors
from common.workdir import Workdir
from training.reporting.attention_weights import SentenceAttention, map_axes

# A weight is stored as round(weight * LEVELS), one byte: it reads back within 0.5 / LEVELS (0.002).
LEVELS = 255
PAGE_FORMAT = 1
PAGE_FILE = "index.html"  # In translate.py's and classify.py's --attention_maps folder.
_TEMPLATE = "attention_page.html"
_DATA_PLACEHOLDER = "/*ATTENTION_DATA*/null"
_TITLE_PLACEHOLDER = "<!--TITLE-->"


@dataclasses.dataclass(frozen=True)
class PageSentence:
    """One sentence of the page: its texts and its attention.

    Attributes:
        name: what the sentence selector calls it, e.g. 'line 3'.
        source: the source text as given.
        target: the target text the decoder was fed (a translation or a given target); '' for
            the classifier.
        target_origin: 'translation' (the model's own), 'given' (from 'source<TAB>target') or ''.
        attention: the weights and the pieces labelling them.
    """

    name: str
    source: str
    target: str
    target_origin: str
    attention: SentenceAttention


def _quantized(weights: np.ndarray) -> np.ndarray:
    """[heads, q_len, kv_len] weights in [0, 1] as bytes, round(weight * LEVELS)."""
    if not np.all(np.isfinite(weights)) or np.any(weights < 0) or np.any(weights > 1 + 1e-6):
        raise ValueError("Attention weights must be finite probabilities in [0, 1].")
    return np.rint(np.clip(weights, 0.0, 1.0) * LEVELS).astype(np.uint8)


def _sentence_data(sentence: PageSentence) -> dict:
    """The page's JSON of one sentence: its texts, its pieces by sequence, each map's name, axes and shape
    [heads, q_len, kv_len], and the quantized weights of every map, in order and row-major, deflated, in base64."""
    attention = sentence.attention
    maps, blocks = [], []
    for name, weights in attention.weights.items():
        stack, layer, kind = name.split("/")
        queries, keys = map_axes(name)
        expected = (len(attention.pieces(queries)), len(attention.pieces(keys)))
        if weights.ndim != 3 or weights.shape[1:] != expected:
            raise ValueError(
                f"{name}: weights {weights.shape} do not match {expected[0]} query and {expected[1]} key pieces."
            )
        maps.append(
            {
                "name": name,
                "stack": stack,
                "layer": int(layer.removeprefix("layer_")),
                "kind": kind,
                "queries": queries,
                "keys": keys,
                "shape": list(weights.shape),
            }
        )
        blocks.append(_quantized(weights).tobytes())
    sequences = ("source", "target", "decoder_input") if attention.target_pieces else ("source",)
    return {
        "name": sentence.name,
        "source": sentence.source,
        "target": sentence.target,
        "target_origin": sentence.target_origin,
        "pieces": {sequence: attention.pieces(sequence) for sequence in sequences},
        "maps": maps,
        "weights": base64.b64encode(zlib.compress(b"".join(blocks), 9)).decode("ascii"),
    }


def _script_json(data: dict) -> str:
    """`data` as JSON that is safe inside a <script> element: no '<' (pieces such as '</s>' would end it)."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")


def attention_page(sentences: Sequence[PageSentence], title: str = "Attention") -> str:
    """The HTML of the page showing `sentences`, in their order."""
    if not sentences:
        raise ValueError("An attention page needs at least one sentence.")
    data = {"format": PAGE_FORMAT, "levels": LEVELS, "sentences": [_sentence_data(s) for s in sentences]}
    template = resources.files(__package__).joinpath(_TEMPLATE).read_text(encoding="utf-8")
    # The data first: the title could hold the data's placeholder, the data (no '<') cannot hold the title's.
    page = template.replace(_DATA_PLACEHOLDER, _script_json(data))
    return page.replace(_TITLE_PLACEHOLDER, html.escape(title))


def write_attention_page(sentences: Sequence[PageSentence], path: str, title: str = "Attention") -> str:
    """Writes the page of `sentences` to `path` (whole or not at all); returns the path."""
    page = attention_page(sentences, title)
    with io_errors.naming(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(path + ".tmp", path)
    return path


def write_evaluation_page(workdir: str, split: str, checkpoint: str, source: str, target: str, attention) -> str:
    """The page of an evaluation's first sentence, `Workdir(workdir).attention_page(split)`: `source` and the
    model's `target` ('' for the classifier) with their `attention`; returns its path."""
    sentence = PageSentence(f"{split} sentence 1", source, target, "translation" if target else "", attention)
    return write_attention_page([sentence], Workdir(workdir).attention_page(split), f"Attention, {split}: {checkpoint}")


def read_attention_page(path: str) -> list[dict]:
    """The sentences embedded in the page at `path`, each map's weights decoded as the page does.

    Returns:
        Per sentence, its embedded fields with 'weights' replaced by {map name: float32 array
        [heads, q_len, kv_len]}, each weight a multiple of 1 / LEVELS.
    """
    with open(path, encoding="utf-8") as f:
        page = f.read()
    start = page.index('<script type="application/json" id="attention-data">')
    start = page.index(">", start) + 1
    data = json.loads(page[start : page.index("</script>", start)])
    if data["format"] != PAGE_FORMAT:
        raise ValueError(f"{path}: attention page format {data['format']}, this code reads {PAGE_FORMAT}.")
    sentences = []
    for sentence in data["sentences"]:
        flat = np.frombuffer(zlib.decompress(base64.b64decode(sentence["weights"])), np.uint8)
        weights, offset = {}, 0
        for entry in sentence["maps"]:
            size = int(np.prod(entry["shape"]))
            levels = flat[offset : offset + size].reshape(entry["shape"])
            weights[entry["name"]] = levels.astype(np.float32) / data["levels"]
            offset += size
        sentences.append({**sentence, "weights": weights})
    return sentences

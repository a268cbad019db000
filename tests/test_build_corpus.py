"""Tests for scripts/build_corpus.py and the shipped LibreOffice help corpus."""

import gzip
import hashlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import build_corpus  # noqa: E402
from help_corpus.pages import parse_page  # noqa: E402
from help_corpus.release import gzip_lines  # noqa: E402
from help_corpus.sentence_pairs import (  # noqa: E402
    MAX_WORDS,
    SPLITS,
    assign_split,
    filter_pairs,
    pair_paragraphs,
    pair_sentences,
    split_pairs,
    split_sentences,
)
from help_corpus.topics import APPLICATION_LABELS, build_labelled_sentences, page_module, split_labelled  # noqa: E402

DATA_DIR = os.path.join(ROOT, "data", "libreoffice_help_en_de")

# Same structure as a real page (text/shared/optionen/01060300.html), shortened.
EN_PAGE = """<!DOCTYPE html>
<html lang="en-US" dir="ltr">
<head>
<meta http-equiv="Content-Type" content="text/html; charset=utf-8">
<title>General</title>
<script type="text/javascript" src="help.js" defer></script>
</head>
<body>
<div id="DisplayArea" itemprop="softwareHelp" itemscope="true">
  <h1 id="hd_id3153311" dir="auto">
    General
  </h1>
  <p id="par_id3156410" class="paragraph" dir="auto">Defines general settings for spreadsheet documents.</p>
  <div class="howtoget"><p class="embedded" dir="auto">No id, not collected.</p></div>
  <p id="par_id3150444" class="paragraph" dir="auto">
    <span class="avis">Defines the unit of measure in spreadsheets.</span>
  </p>
  <div class="notetext"><p id="par_id050420171020567355" dir="auto">Set it in <span id="swlnsys_1" class="switchinline"><span hidden="true" id="MACtext_1" class="MAC"><span class="menuitem">LibreOffice - Preferences</span>
</span><span hidden="true" id="defaulttext_1"><span class="menuitem">Tools - Options</span></span></span> <span class="menuitem">- LibreOffice &ndash; Security</span>.<br>Then click &quot;OK&quot; &amp; close.</p></div>
  <span id="swlnappl_2" class="switch">
    <span hidden="true" id="CALCtext_2" class="CALC">
      <h2 id="hd_id271641582528169" dir="auto">Formatted Display</h2>
    </span>
  </span>
  <p id="par_id1" class="paragraph" dir="auto">Secret <span class="hidden">invisible </span>text.</p>
  <p id="par_id2" class="paragraph" dir="auto"></p>
  <p id="par_id3" class="paragraph" dir="auto">Embedded twice.</p>
  <p id="par_id3" class="paragraph" dir="auto">Embedded twice.</p>
</div>
<footer><div id="DEBUG" class="debug">
<p id="bm_module" dir="auto">debug</p>
</div></footer>
</body>
</html>
"""


def test_parse_page_collects_ids_and_skips_hidden():
    texts = parse_page(EN_PAGE)
    assert texts["hd_id3153311"] == "General"
    assert texts["par_id3156410"] == "Defines general settings for spreadsheet documents."
    assert texts["par_id3150444"] == "Defines the unit of measure in spreadsheets."
    # macOS variant (hidden) dropped, default switch case kept, entities decoded, <br> -> space.
    assert texts["par_id050420171020567355"] == (
        "Set it in Tools - Options - LibreOffice \u2013 Security. Then click \"OK\" & close."
    )
    assert "hd_id271641582528169" not in texts  # module-specific hidden block
    assert texts["par_id1"] == "Secret text."  # class="hidden" span skipped
    assert texts["par_id2"] == ""
    assert texts["par_id3"] == texts["par_id3#2"] == "Embedded twice."
    assert not any(k.startswith("bm_") for k in texts)
    assert all("No id" not in v and "Preferences" not in v for v in texts.values())


def test_pair_paragraphs_by_id():
    en = {"a": "One.", "b": "Two.", "c": "", "d": "Only English."}
    de = {"b": "Zwei.", "a": "Eins.", "c": "Leer.", "e": "Nur Deutsch."}
    assert pair_paragraphs(en, de) == [("One.", "Eins."), ("Two.", "Zwei.")]


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "First sentence. Second one! Third? 4 items.",
            ["First sentence.", "Second one!", "Third?", "4 items."],
        ),
        ("Use e.g. Calc or i.e. Writer. Done.", ["Use e.g. Calc or i.e. Writer.", "Done."]),
        (
            "Zum Beispiel z. B. Calc, d. h. Writer usw. Fertig.",
            ["Zum Beispiel z. B. Calc, d. h. Writer usw. Fertig."],
        ),
        (
            "Siehe Nr. 5 und vgl. Abschnitt 3. Spalte A. Ende.",
            ["Siehe Nr. 5 und vgl. Abschnitt 3. Spalte A. Ende."],
        ),
        (
            "Der Wert ist 1.5 oder 2,5. Danach folgt mehr.",
            ["Der Wert ist 1.5 oder 2,5.", "Danach folgt mehr."],
        ),
        ("Choose Tools - Options... Security tab.", ["Choose Tools - Options... Security tab."]),
        ("It ends with \"Quote.\" Next sentence.", ["It ends with \"Quote.\"", "Next sentence."]),
        ("Cell B1 contains 2006. In cell B2 enter it.", ["Cell B1 contains 2006.", "In cell B2 enter it."]),
        ("Lower case after dot. then no split.", ["Lower case after dot. then no split."]),
        ("Register: Makro", ["Register: Makro"]),
        ("", []),
    ],
)
def test_split_sentences(text, expected):
    assert split_sentences(text) == expected


def test_split_sentences_colon_option():
    assert split_sentences("Note: The value.", split_on_colon=True) == ["Note:", "The value."]
    assert split_sentences("Note: the value.", split_on_colon=True) == ["Note: the value."]


def test_pair_sentences_requires_equal_counts():
    paras = [
        ("One. Two.", "Eins. Zwei."),
        ("Long sentence here.", "Langer Satz. Hier."),
    ]
    assert list(pair_sentences(paras)) == [("One.", "Eins."), ("Two.", "Zwei.")]


def test_filters_and_dedup():
    pairs = [
        ("Hello  world.", "Hallo Welt."),
        ("Hello world.", "Hallo  Welt."),  # duplicate after normalisation
        ("Hello world.", "Hallo Erde."),  # same English, different German: kept
        ("123 456", "123 456"),  # no letters
        ("", "Leer"),
        ("Short.", "Ein sehr langer deutscher Satz, der gar nicht zum Original passt."),
        ("This text was not translated.", "This text was not translated."),
        ("SUM", "SUM"),  # short identical names are kept
        (" ".join(["word"] * (MAX_WORDS + 1)), " ".join(["Wort"] * (MAX_WORDS + 1))),
    ]
    kept, stats = filter_pairs(pairs)
    assert kept == [("Hello world.", "Hallo Welt."), ("Hello world.", "Hallo Erde."), ("SUM", "SUM")]
    assert stats == {
        "duplicate": 1,
        "no_letters": 1,
        "empty": 1,
        "length_ratio": 1,
        "untranslated": 1,
        "too_long": 1,
    }


def test_assign_split_deterministic_and_by_english():
    sentences = [f"Sentence number {i}." for i in range(5000)]
    first = [assign_split(s) for s in sentences]
    assert first == [assign_split(s) for s in sentences]
    assert set(first) == {"train", "valid", "test"}
    assert 150 < first.count("valid") < 350 and 150 < first.count("test") < 350
    splits = split_pairs([("Same English.", f"Deutsch {i}") for i in range(20)])
    assert sorted(len(v) for v in splits.values()) == [0, 0, 20]


def test_gzip_lines_reproducible():
    a = gzip_lines(["eins", "zwei"])
    assert a == gzip_lines(["eins", "zwei"])
    assert gzip.decompress(a).decode("utf-8") == "eins\nzwei\n"
    assert a[4:8] == b"\0\0\0\0"  # mtime 0
    with pytest.raises(ValueError):
        gzip_lines(["tab\tinside"])


def test_missing_deb_exits_2(capsys, tmp_path):
    rc = build_corpus.main(
        [
            "--en-deb",
            str(tmp_path / "nope.deb"),
            "--de-deb",
            str(tmp_path / "x.deb"),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("build_corpus.py: error: missing .deb file") and "\n" not in err


# --------------------------------------------------------------------------
# The shipped data
# --------------------------------------------------------------------------


def _read_lines(name):
    with gzip.open(os.path.join(DATA_DIR, name), "rt", encoding="utf-8", newline="\n") as f:
        return f.read().split("\n")[:-1]


def test_shipped_corpus():
    files = [f"{split}.{lang}.gz" for split in SPLITS for lang in ("en", "de")]
    for name in files + ["README.md", "LICENSE", "SHA256SUMS"]:
        assert os.path.isfile(os.path.join(DATA_DIR, name)), name

    with open(os.path.join(DATA_DIR, "SHA256SUMS"), encoding="utf-8") as f:
        sums = dict(reversed(line.split("  ", 1)) for line in f.read().splitlines())
    assert set(sums) == set(files)
    for name in files:
        with open(os.path.join(DATA_DIR, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == sums[name], name

    english = {}
    for split in SPLITS:
        en, de = _read_lines(f"{split}.en.gz"), _read_lines(f"{split}.de.gz")
        assert len(en) == len(de) > 0, split
        assert all(s and "\t" not in s and s == s.strip() for s in en + de)
        if split != "train":
            assert 1500 <= len(en) <= 2500, (split, len(en))
        english[split] = set(en)
        assert all(assign_split(s) == split for s in english[split])
    assert not english["train"] & english["valid"]
    assert not english["train"] & english["test"]
    assert not english["valid"] & english["test"]


# --------------------------------------------------------------------------
# The text-classification corpus (English sentences labelled by application)
# --------------------------------------------------------------------------

TOPICS_DIR = os.path.join(ROOT, "data", "libreoffice_help_topics")


def _page(*paragraphs):
    body = "".join(f'<p id="par_id{i}" dir="auto">{text}</p>' for i, text in enumerate(paragraphs))
    return f'<html><body><div id="DisplayArea">{body}</div></body></html>'


def test_page_module_from_the_path():
    assert page_module("text/scalc/01/04060101.html") == "scalc"
    assert page_module("text/shared/optionen/01060300.html") == "shared"
    assert page_module("noscript.html") is None
    assert page_module("text/main.html") is None


def test_build_labelled_sentences_labels_by_application_and_drops_ambiguous_ones():
    pages = {
        "text/scalc/01/a.html": _page("Sums a range. Click OK.", "Pivot tables summarise data.", "123"),
        "text/swriter/01/b.html": _page("Click OK.", "Inserts a page break.", "Inserts a page break."),
        "text/sdraw/guide/c.html": _page("Draws a shape."),
        "text/simpress/01/d.html": _page("Draws a shape. Starts the slide show."),
        "text/shared/01/e.html": _page("Pivot tables summarise data.", "Opens a dialog."),
        "text/unknown/f.html": _page("Never read."),
    }
    pairs, stats = build_labelled_sentences(pages)
    assert pairs == [
        ("calc", "Sums a range."),
        ("impress_draw", "Draws a shape."),  # Draw and Impress share one label: not ambiguous.
        ("impress_draw", "Starts the slide show."),
        ("writer", "Inserts a page break."),  # Deduplicated.
    ]
    # "Click OK." is on Calc and Writer pages; "Pivot tables ..." also on a shared page.
    assert stats["ambiguous"] == 2 and stats["shared"] == 1 and stats["no_letters"] == 1
    assert stats["kept"] == 4 and stats["label:impress_draw"] == 2


def test_split_labelled_follows_the_hash_of_the_sentence():
    pairs = [("calc", f"Sentence number {i}.") for i in range(400)]
    splits = split_labelled(pairs)
    assert sum(len(v) for v in splits.values()) == 400
    for split, members in splits.items():
        assert all(assign_split(sentence) == split for _, sentence in members)


def test_gzip_lines_with_fields():
    blob = gzip_lines(["calc\tSums a range."], fields=2)
    assert gzip.decompress(blob).decode("utf-8") == "calc\tSums a range.\n"
    for bad in (["no tab"], ["a\tb\tc"]):
        with pytest.raises(ValueError):
            gzip_lines(bad, fields=2)


def _read_topics(split):
    with gzip.open(os.path.join(TOPICS_DIR, f"{split}.tsv.gz"), "rt", encoding="utf-8", newline="\n") as f:
        return [line.split("\t") for line in f.read().split("\n")[:-1]]


def test_shipped_topics_corpus():
    files = [f"{split}.tsv.gz" for split in SPLITS]
    for name in files + ["README.md", "LICENSE", "SHA256SUMS"]:
        assert os.path.isfile(os.path.join(TOPICS_DIR, name)), name
    with open(os.path.join(TOPICS_DIR, "SHA256SUMS"), encoding="utf-8") as f:
        sums = dict(reversed(line.split("  ", 1)) for line in f.read().splitlines())
    assert set(sums) == set(files)
    for name in files:
        with open(os.path.join(TOPICS_DIR, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == sums[name], name

    labels = set(APPLICATION_LABELS.values())
    sentences = {}
    for split in SPLITS:
        rows = _read_topics(split)
        assert all(len(row) == 2 and row[0] in labels and row[1] == row[1].strip() and row[1] for row in rows)
        sentences[split] = [sentence for _, sentence in rows]
        assert len(set(sentences[split])) == len(rows), split  # Deduplicated.
        assert all(assign_split(s) == split for s in sentences[split])
        if split != "train":
            assert 1000 <= len(rows) <= 2000, (split, len(rows))
            # Every label is in every split, with enough examples to evaluate.
            counts = {label: sum(1 for row in rows if row[0] == label) for label in labels}
            assert min(counts.values()) >= 40, counts
    train, valid, test = (set(sentences[s]) for s in SPLITS)
    assert not train & valid and not train & test and not valid & test

"""The text-classification corpus: English sentences labelled by the application whose help page they are on."""

from __future__ import annotations

from typing import Iterable, Iterator

from help_corpus.debs import EN_LANG, HELP_ROOT, DebContents
from help_corpus.pages import normalize_text, parse_page
from help_corpus.release import gzip_lines, write_release
from help_corpus.sentence_pairs import (
    HASH_MODULUS,
    MAX_WORDS,
    SPLITS,
    TEST_BUCKETS,
    VALID_BUCKETS,
    assign_split,
    rejection_reason,
    split_sentences,
)

# Page folder text/<module>/ -> label. Every application with its own help
# folder is a class, except that Draw (text/sdraw, ~500 sentences: ~25 in a 5%
# test split, too few to evaluate) is merged with Impress (text/simpress): the
# two share one drawing engine, toolbars and most dialogs, and their help pages
# say so. text/shared (dialogs, options and guides common to every application)
# belongs to no single application and has no label; its sentences are dropped.
APPLICATION_LABELS = {
    "swriter": "writer",
    "scalc": "calc",
    "simpress": "impress_draw",
    "sdraw": "impress_draw",
    "sbasic": "basic",
    "smath": "math",
    "sdatabase": "base",
    "schart": "chart",
}
SHARED_MODULE = "shared"


def page_module(path: str) -> str | None:
    """The help module of a page path relative to help/<lang>/: 'text/scalc/01/x.html' -> 'scalc'."""
    parts = path.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "text" else None


def page_sentences(html_text: str) -> Iterator[str]:
    """The normalised sentences of a page's visible paragraphs, in document order."""
    for text in parse_page(html_text).values():
        for sentence in split_sentences(text):
            yield normalize_text(sentence)


def build_labelled_sentences(pages: dict[str, str]) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """From ``{relative page path: html}`` (one language) to ``(label, sentence)`` pairs.

    A sentence is labelled with the application of the pages it appears on
    (:data:`APPLICATION_LABELS`) and kept once (deduplicated, at its first
    occurrence in sorted page order). A sentence found on pages of two labels,
    or also on a shared page, is dropped ("ambiguous"): the same words describe
    several applications, so no label is right. The English filters of
    :func:`rejection_reason` apply (no letters, more than MAX_WORDS words).

    Returns:
        (pairs in document order, counts: 'ambiguous', 'no_letters', 'too_long', 'shared',
        'kept' and per-label 'label:<name>').
    """
    modules_of: dict[str, set[str]] = {}
    stats: dict[str, int] = {}
    for path in sorted(pages):
        module = page_module(path)
        if module != SHARED_MODULE and module not in APPLICATION_LABELS:
            continue
        for sentence in page_sentences(pages[path]):
            reason = rejection_reason(sentence, sentence) if sentence else "empty"
            if reason in ("empty", "no_letters", "too_long"):
                stats[reason] = stats.get(reason, 0) + 1
                continue
            modules_of.setdefault(sentence, set()).add(module)
    kept = []
    for sentence, modules in modules_of.items():  # Insertion order: first occurrence.
        labels = {APPLICATION_LABELS.get(m) for m in modules}
        if len(labels) > 1:
            stats["ambiguous"] = stats.get("ambiguous", 0) + 1
        elif labels == {None}:
            stats["shared"] = stats.get("shared", 0) + 1
        else:
            (label,) = labels
            kept.append((label, sentence))
            stats[f"label:{label}"] = stats.get(f"label:{label}", 0) + 1
    stats["kept"] = len(kept)
    return kept, stats


def split_labelled(pairs: Iterable[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Group ``(label, sentence)`` pairs by :func:`assign_split` of the sentence, keeping their order."""
    out: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
    for label, sentence in pairs:
        out[assign_split(sentence)].append((label, sentence))
    return out


def render_topics_readme(en: DebContents, splits: dict[str, list[tuple[str, str]]], stats: dict[str, int]) -> str:
    """The topics folder's README.md (deterministic)."""
    labels = sorted({label for pairs in splits.values() for label, _ in pairs})
    header = "| label | " + " | ".join(SPLITS) + " | help folders |"
    rows = [header, "|---|" + "---:|" * len(SPLITS) + "---|"]
    for label in labels:
        counts = [sum(1 for lab, _ in splits[name] if lab == label) for name in SPLITS]
        folders = ", ".join(f"`text/{m}`" for m, lab in APPLICATION_LABELS.items() if lab == label)
        rows.append(f"| `{label}` | " + " | ".join(f"{c:,}" for c in counts) + f" | {folders} |")
    totals = [len(splits[name]) for name in SPLITS]
    rows.append("| **all** | " + " | ".join(f"{c:,}" for c in totals) + " | |")
    table = "\n".join(rows)
    version = en.version.split(":")[-1].split("-")[0]
    return f"""# LibreOffice help sentences labelled by application

English sentences from the LibreOffice {version} offline help (The Document Foundation), each labelled
with the application whose help pages it comes from: a small, real text-classification task.

## Files

`{{train,valid,test}}.tsv.gz`: gzip (mtime 0), UTF-8, one example per line, `label<TAB>sentence`.
`SHA256SUMS` holds their checksums (`sha256sum -c SHA256SUMS`).

{table}

## Source

`{en.package}` `{en.version}` (`{en.filename}`, sha256 `{en.sha256}`), Debian bookworm; pages under
`{HELP_ROOT}/{EN_LANG}/text/<module>/`.

## How it was built

```
python scripts/build_corpus.py --en-deb {en.filename} --de-deb <the German package> \\
    --out data/libreoffice_help_en_de --topics-out data/libreoffice_help_topics
```

1. Every page's visible paragraphs are parsed and split into sentences exactly as for the
   English-German corpus (`../libreoffice_help_en_de/README.md`, steps 1, 2 and 4); sentences without
   letters or with more than {MAX_WORDS} words are dropped ({stats.get('no_letters', 0):,} and
   {stats.get('too_long', 0):,}).
2. Label = the page's folder `text/<module>/`: `swriter` → `writer`, `scalc` → `calc`, `sbasic` →
   `basic`, `smath` → `math`, `sdatabase` → `base`, `schart` → `chart`, and `simpress` and `sdraw`
   → `impress_draw`. Draw is merged with Impress: it has too few sentences (~500, ~25 in a test split)
   to evaluate on its own, and the two applications share one drawing engine, toolbars and most dialogs.
   `text/shared` (dialogs, options and guides common to every application) names no application:
   its sentences are not used.
3. Each distinct sentence is kept once. A sentence that appears on pages of two labels, or also on a
   shared page, is dropped as ambiguous ({stats.get('ambiguous', 0):,} sentences; e.g. "Click OK."), as are
   {stats.get('shared', 0):,} sentences found on shared pages only. Kept: {stats['kept']:,}.
4. Split by the sentence: `int(sha256(utf8(sentence))) % {HASH_MODULUS}` in
   [{VALID_BUCKETS.start}, {VALID_BUCKETS.stop}) → valid, [{TEST_BUCKETS.start}, {TEST_BUCKETS.stop}) → test,
   otherwise train: the rule of the English-German corpus, so no sentence is in two splits, and no
   test sentence here is a training sentence there. Within a split, sentences keep document order
   (pages sorted by path); training shuffles them.

Caveats: help sentences are short and repetitive; near-duplicates (differing in a word, e.g. a function
name) can fall into different splits. Some sentences are generic ("Select the range.") and are labelled
by where they happen to appear.

## Licence

MPL-2.0, as the English-German corpus: see `LICENSE`. Attribution: LibreOffice help, The Document
Foundation; Copyright 2000, 2010 Oracle and/or its affiliates; Copyright (c) 2000, 2010 LibreOffice
contributors and/or their affiliates. This directory contains extracted, sentence-split and labelled
text of that help, made available under the same licence.
"""


def write_topics_output(
    out_dir: str, splits: dict[str, list[tuple[str, str]]], readme: str, license_txt: str
) -> dict[str, str]:
    """Write ``{split}.tsv.gz``, README.md, LICENSE and SHA256SUMS; return checksums."""
    blobs = {
        f"{name}.tsv.gz": gzip_lines([f"{label}\t{sentence}" for label, sentence in splits[name]], fields=2)
        for name in SPLITS
    }
    return write_release(out_dir, blobs, readme, license_txt)

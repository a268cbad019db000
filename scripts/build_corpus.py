#!/usr/bin/env python3
"""Build the bundled English-German corpus from the LibreOffice offline help.

Source: the Debian packages ``libreoffice-help-en-us`` and ``libreoffice-help-de``
(LibreOffice help, The Document Foundation, MPL-2.0). Both packages ship the same
help pages under ``usr/share/libreoffice/help/<lang>/`` at identical relative
paths, and every paragraph/heading carries a stable ``id`` (``par_id…``,
``hd_id…``), so the two languages can be aligned by ``(page, id)``.

Pipeline (all steps are small pure functions, in the modules of ``help_corpus/``):

1. read the ``.deb`` files (pure Python: ``ar`` archive + ``tarfile``; falls back
   to ``dpkg-deb --fsys-tarfile`` for compressions ``tarfile`` cannot read;
   ``debs.load_deb``);
2. parse every help page into ``{id: text}`` (``pages.parse_page``), skipping
   hidden content (see below), scripts and styles;
3. pair paragraphs by ``(page, id)`` (``sentence_pairs.pair_paragraphs``);
4. split both sides into sentences (``sentence_pairs.split_sentences``) and keep
   sentence pairs only where both sides give the same number of sentences
   (``sentence_pairs.pair_sentences``);
5. normalise whitespace, deduplicate exact ``(en, de)`` pairs and drop outliers
   (``sentence_pairs.filter_pairs``);
6. assign each pair to train/valid/test by a hash of its English side
   (``sentence_pairs.assign_split``), so one English sentence never lands in two splits;
7. write ``{train,valid,test}.{en,de}.gz`` (gzip ``mtime=0``), ``README.md``,
   ``LICENSE`` and ``SHA256SUMS`` (``release.write_output``).

With ``--topics-out``, it also writes a text-classification corpus from the
English pages alone: every English sentence labelled with the application its
page documents (``topics.build_labelled_sentences``, labels in
``topics.APPLICATION_LABELS``), split by the same hash rule, as
``{train,valid,test}.tsv.gz`` (``label<TAB>sentence``).

Hidden content: the help uses ``<span class="switch">`` / ``<span
class="switchinline">`` containers whose children are ``hidden="true"`` cases
(one per OS or module, e.g. ``id="MAC…"``, ``id="CALC…"``, plus a fallback case
with ``id="default…"``); the help viewer's JavaScript un-hides one of them. We
keep the fallback ``default…`` case of a switch (the text a reader normally
sees, e.g. "Tools - Options") and skip every other hidden element and its
whole subtree (so "LibreOffice - Preferences" for macOS, and module-specific
paragraphs, are dropped). An element counts as hidden when it has a ``hidden``
attribute or a ``hidden`` class token.

Usage::

    python scripts/build_corpus.py \\
        --en-deb libreoffice-help-en-us_..._all.deb \\
        --de-deb libreoffice-help-de_..._all.deb \\
        --out data/libreoffice_help_en_de --topics-out data/libreoffice_help_topics

If ``--en-deb``/``--de-deb`` are omitted, the packages are fetched with
``apt-get download libreoffice-help-en-us libreoffice-help-de`` into a temporary
directory (run ``apt-get update`` first if apt does not know the packages; the
version is then whatever your apt sources provide).

The same input always gives byte-identical output. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Sequence

from help_corpus.debs import DE_LANG, DE_PACKAGE, EN_LANG, EN_PACKAGE, BuildError, apt_download, load_deb
from help_corpus.release import license_text, render_readme, write_output
from help_corpus.sentence_pairs import SPLITS, build_pairs, split_pairs
from help_corpus.topics import build_labelled_sentences, render_topics_readme, split_labelled, write_topics_output


def run(en_deb: str, de_deb: str, out_dir: str, topics_out: str | None = None) -> dict[str, int]:
    """Build the corpus from two .deb files into ``out_dir`` (and the topics into ``topics_out``).

    Returns the split sizes.
    """
    en = load_deb(en_deb, EN_LANG)
    de = load_deb(de_deb, DE_LANG)
    pairs, stats = build_pairs(en.pages, de.pages)
    splits = split_pairs(pairs)
    out_name = os.path.relpath(out_dir) if not os.path.isabs(out_dir) else os.path.basename(out_dir)
    readme = render_readme(en, de, splits, stats, out_name.replace(os.sep, "/"))
    licence = license_text([en.copyright, de.copyright])
    write_output(out_dir, splits, readme, licence)
    counts = {name: len(splits[name]) for name in SPLITS}
    if topics_out:
        labelled, topic_stats = build_labelled_sentences(en.pages)
        topic_splits = split_labelled(labelled)
        write_topics_output(topics_out, topic_splits, render_topics_readme(en, topic_splits, topic_stats), licence)
        counts.update({f"topics_{name}": len(topic_splits[name]) for name in SPLITS})
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--en-deb", help=f"path to the {EN_PACKAGE} .deb (default: apt-get download)")
    ap.add_argument("--de-deb", help=f"path to the {DE_PACKAGE} .deb (default: apt-get download)")
    ap.add_argument("--out", required=True, help="output directory, e.g. data/libreoffice_help_en_de")
    ap.add_argument(
        "--topics-out",
        help="also write English sentences labelled by application here, e.g. data/libreoffice_help_topics",
    )
    args = ap.parse_args(argv)
    try:
        if bool(args.en_deb) != bool(args.de_deb):
            raise BuildError("give both --en-deb and --de-deb, or neither (to use apt-get download)")
        if args.en_deb:
            for path in (args.en_deb, args.de_deb):
                if not os.path.isfile(path):
                    raise BuildError(f"missing .deb file: {path}")
            counts = run(args.en_deb, args.de_deb, args.out, args.topics_out)
        else:
            with tempfile.TemporaryDirectory(prefix="lo-help-debs-") as tmp:
                en_deb, de_deb = apt_download(tmp)
                counts = run(en_deb, de_deb, args.out, args.topics_out)
    except BuildError as e:
        print(f"build_corpus.py: error: {e}", file=sys.stderr)
        return 2
    print(" ".join(f"{k}={v}" for k, v in counts.items()), f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Writing a corpus folder reproducibly: gzipped data files, SHA256SUMS, README.md and LICENSE."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
from typing import Sequence

from help_corpus.debs import DE_LANG, DE_PACKAGE, EN_LANG, EN_PACKAGE, HELP_ROOT, DebContents
from help_corpus.sentence_pairs import (
    HASH_MODULUS,
    LENGTH_RATIO_SMOOTHING,
    MAX_LENGTH_RATIO,
    MAX_WORDS,
    MIN_WORDS_UNTRANSLATED,
    SPLITS,
    TEST_BUCKETS,
    VALID_BUCKETS,
)

MPL_URL = "https://www.mozilla.org/MPL/2.0/"
SYSTEM_MPL_PATH = "/usr/share/common-licenses/MPL-2.0"


def gzip_lines(lines: Sequence[str], fields: int = 1) -> bytes:
    """Gzip ``lines`` (one per line, UTF-8) reproducibly: no file name, mtime=0.

    Each line must hold ``fields`` tab-separated fields (so ``fields - 1`` tabs) and no newline.
    """
    for line in lines:
        if "\n" in line or "\r" in line or line.count("\t") != fields - 1:
            raise ValueError(f"line contains a newline or not {fields} tab-separated fields: {line!r}")
    payload = "".join(line + "\n" for line in lines).encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(payload)
    return buf.getvalue()


def mean_words(lines: Sequence[str]) -> float:
    """Mean number of whitespace-separated words per line (0.0 if empty)."""
    return sum(len(s.split()) for s in lines) / len(lines) if lines else 0.0


def license_text(copyright_texts: Sequence[str]) -> str:
    """MPL-2.0 text: from the packages' copyright file if it contains the full
    text, else /usr/share/common-licenses/MPL-2.0, else a pointer to it."""
    for text in copyright_texts:
        if "Mozilla Public License Version 2.0" in text and "Exhibit A" in text:
            return text
    if os.path.isfile(SYSTEM_MPL_PATH):
        with open(SYSTEM_MPL_PATH, encoding="utf-8") as f:
            return f.read()
    return (
        "The texts in this directory are taken from the LibreOffice help\n"
        "(The Document Foundation) and are licensed under the Mozilla Public\n"
        f"License, v. 2.0. The full licence text is available at {MPL_URL}\n"
    )


def render_readme(
    en: DebContents,
    de: DebContents,
    splits: dict[str, list[tuple[str, str]]],
    stats: dict[str, int],
    out_dir_name: str,
) -> str:
    """The output folder's README.md (deterministic: no dates, no absolute paths)."""
    rows = []
    all_en: list[str] = []
    all_de: list[str] = []
    for name in SPLITS:
        en_lines = [p[0] for p in splits[name]]
        de_lines = [p[1] for p in splits[name]]
        all_en += en_lines
        all_de += de_lines
        rows.append(f"| {name} | {len(en_lines):,} | {mean_words(en_lines):.1f} | {mean_words(de_lines):.1f} |")
    rows.append(f"| **all** | {len(all_en):,} | {mean_words(all_en):.1f} | {mean_words(all_de):.1f} |")
    dropped = ", ".join(
        f"{k}: {stats.get(k, 0):,}"
        for k in ("duplicate", "empty", "no_letters", "too_long", "length_ratio", "untranslated")
    )
    table = "\n".join(rows)
    return f"""# LibreOffice help English-German parallel corpus

Sentence-aligned English-German text from the LibreOffice {en.version.split(':')[-1].split('-')[0]} offline help
(LibreOffice help, The Document Foundation), for small machine-translation experiments.

## Files

`{{train,valid,test}}.{{en,de}}.gz`: gzip (mtime 0), UTF-8, one sentence per line, the `.en` and `.de` files
of a split are aligned line by line. `SHA256SUMS` holds their checksums (`sha256sum -c SHA256SUMS`).

| split | pairs | mean words (en) | mean words (de) |
|---|---:|---:|---:|
{table}

## Source

| package | version | file | sha256 |
|---|---|---|---|
| `{en.package}` | `{en.version}` | `{en.filename}` | `{en.sha256}` |
| `{de.package}` | `{de.version}` | `{de.filename}` | `{de.sha256}` |

Debian bookworm packages; the help pages live under `{HELP_ROOT}/{{{EN_LANG},{DE_LANG}}}/`.

## How it was built

```
python scripts/build_corpus.py --en-deb {en.filename} --de-deb {de.filename} --out {out_dir_name}
```

(Without `--en-deb/--de-deb` the script runs `apt-get download {EN_PACKAGE} {DE_PACKAGE}`;
run `apt-get update` first if needed.) The build is deterministic: the same packages give
byte-identical `.gz` files (and this README, up to the `--out` path in the command). Steps:

1. Parse all {stats['pages_common']:,} help pages present in both languages ({stats['pages_en']:,} en-US,
   {stats['pages_de']:,} de). Collect the text of every `<p>`/`<h1>`..`<h6>` with an `id`
   (`par_id…`, `hd_id…`); entities decoded, whitespace collapsed, Unicode NFC.
2. Hidden content is skipped: elements with a `hidden` attribute/class and their subtrees. Exception:
   inside `switch`/`switchinline` containers (per-OS/per-module variants, all `hidden="true"`), the
   fallback case `id="default…"` is kept (what the help viewer shows by default, e.g. "Tools - Options"),
   the OS/module-specific cases (`MAC…`, `CALC…`, …) are dropped.
3. Pair paragraphs by (page path, id): {stats['paragraph_pairs']:,} non-empty paragraph pairs.
4. Split both sides into sentences with a rule-based splitter: break after `. ! ?` (+ optional closing
   quotes/brackets) followed by whitespace and an upper-case letter or digit; no break after known
   abbreviations (`e.g.`, `i.e.`, `etc.`, `z. B.`, `d. h.`, `usw.`, `bzw.`, `Nr.`, `vgl.`, …), single letters,
   one- or two-digit numbers (German ordinals/dates: `3. Spalte`, `31. März`) or ellipses. Colons are
   not boundaries (German capitalises the noun after `Register:`/`Tastatur:`, English does not).
   Keep a paragraph only if both sides give the same number of sentences: {stats['sentence_pairs']:,} sentence pairs.
5. Filters: drop exact duplicate (en, de) pairs (first occurrence kept); drop pairs with an empty side, an
   English side without letters, more than {MAX_WORDS} words on either side, a character length ratio
   (longer + {LENGTH_RATIO_SMOOTHING}) / (shorter + {LENGTH_RATIO_SMOOTHING}) > {MAX_LENGTH_RATIO}, or identical
   en/de sides of at least {MIN_WORDS_UNTRANSLATED} words (untranslated text). Dropped: {dropped}.
   Kept: {stats['kept']:,}.
6. Split by the English side: `int(sha256(utf8(en))) % {HASH_MODULUS}` in [{VALID_BUCKETS.start}, {VALID_BUCKETS.stop})
   → valid, [{TEST_BUCKETS.start}, {TEST_BUCKETS.stop}) → test, otherwise train. An English sentence therefore
   never appears in two splits. Within a split, pairs keep document order (pages sorted by path).

Caveats: help texts are short, UI-heavy and repetitive (menu paths, option names); near-duplicates
(differing in a word) can still occur across splits, and the same German sentence can occur in two splits
with different English sides.

## Licence

The LibreOffice help is licensed under the Mozilla Public License, v. 2.0 (MPL-2.0),
{MPL_URL} (see `LICENSE`; Debian's `copyright` file of both packages lists `License: MPL-2.0`,
with some files incorporating Apache-2.0 licensed material from Apache OpenOffice).
Attribution: LibreOffice help, The Document Foundation; Copyright 2000, 2010 Oracle and/or its
affiliates; Copyright (c) 2000, 2010 LibreOffice contributors and/or their affiliates. This directory
contains extracted and sentence-split text of that help, made available under the same licence.
"""


def write_output(
    out_dir: str,
    splits: dict[str, list[tuple[str, str]]],
    readme: str,
    license_txt: str,
) -> dict[str, str]:
    """Write the six .gz files, README.md, LICENSE and SHA256SUMS; return checksums."""
    blobs = {
        f"{name}.{lang}.gz": gzip_lines([pair[idx] for pair in splits[name]])
        for name in SPLITS
        for idx, lang in enumerate(("en", "de"))
    }
    return write_release(out_dir, blobs, readme, license_txt)


def write_release(out_dir: str, blobs: dict[str, bytes], readme: str, license_txt: str) -> dict[str, str]:
    """Write the data files, SHA256SUMS, README.md and LICENSE of a corpus; return the checksums."""
    os.makedirs(out_dir, exist_ok=True)
    sums: dict[str, str] = {}
    for fname, blob in blobs.items():
        with open(os.path.join(out_dir, fname), "wb") as f:
            f.write(blob)
        sums[fname] = hashlib.sha256(blob).hexdigest()
    with open(os.path.join(out_dir, "SHA256SUMS"), "w", encoding="utf-8", newline="\n") as f:
        f.writelines(f"{digest}  {fname}\n" for fname, digest in sums.items())
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8", newline="\n") as f:
        f.write(readme)
    with open(os.path.join(out_dir, "LICENSE"), "w", encoding="utf-8", newline="\n") as f:
        f.write(license_txt)
    return sums

#!/usr/bin/env python3
"""Build the bundled English-German corpus from the LibreOffice offline help.

Source: the Debian packages ``libreoffice-help-en-us`` and ``libreoffice-help-de``
(LibreOffice help, The Document Foundation, MPL-2.0). Both packages ship the same
help pages under ``usr/share/libreoffice/help/<lang>/`` at identical relative
paths, and every paragraph/heading carries a stable ``id`` (``par_id…``,
``hd_id…``), so the two languages can be aligned by ``(page, id)``.

Pipeline (all steps are small pure functions, see below):

1. read the ``.deb`` files (pure Python: ``ar`` archive + ``tarfile``; falls back
   to ``dpkg-deb --fsys-tarfile`` for compressions ``tarfile`` cannot read);
2. parse every help page into ``{id: text}`` (:func:`parse_page`), skipping
   hidden content (see below), scripts and styles;
3. pair paragraphs by ``(page, id)`` (:func:`pair_paragraphs`);
4. split both sides into sentences (:func:`split_sentences`) and keep sentence
   pairs only where both sides give the same number of sentences
   (:func:`pair_sentences`);
5. normalise whitespace, deduplicate exact ``(en, de)`` pairs and drop outliers
   (:func:`filter_pairs`);
6. assign each pair to train/valid/test by a hash of its English side
   (:func:`assign_split`), so one English sentence never lands in two splits;
7. write ``{train,valid,test}.{en,de}.gz`` (gzip ``mtime=0``), ``README.md``,
   ``LICENSE`` and ``SHA256SUMS``.

With ``--topics-out``, it also writes a text-classification corpus from the
English pages alone: every English sentence labelled with the application its
page documents (:func:`build_labelled_sentences`, labels in
:data:`APPLICATION_LABELS`), split by the same hash rule, as
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
import glob
import gzip
import hashlib
import html.parser
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

EN_PACKAGE = "libreoffice-help-en-us"
DE_PACKAGE = "libreoffice-help-de"
HELP_ROOT = "usr/share/libreoffice/help"
EN_LANG = "en-US"
DE_LANG = "de"

SPLITS = ("train", "valid", "test")
# sha256(English sentence) mod HASH_MODULUS -> bucket; buckets [0, 50) -> valid,
# [50, 100) -> test, the rest -> train (about 5% / 5% / 90%).
HASH_MODULUS = 1000
VALID_BUCKETS = range(0, 50)
TEST_BUCKETS = range(50, 100)

# Filter thresholds (documented in the output README).
MAX_WORDS = 80  # drop a pair if either side has more whitespace-separated words
MAX_LENGTH_RATIO = 2.5  # drop if (longer + 10) / (shorter + 10) chars exceeds this
LENGTH_RATIO_SMOOTHING = 10
MIN_WORDS_UNTRANSLATED = 4  # drop en == de pairs with at least this many words
# Colons are not sentence boundaries by default: German capitalises every noun, so
# "Register: Makro" / "Tastatur: Strg+A" would split in German but not in English
# and lose the pair (measured on 7.4.7: ~350 fewer sentence pairs with colon splitting).
SPLIT_ON_COLON = False

MPL_URL = "https://www.mozilla.org/MPL/2.0/"
SYSTEM_MPL_PATH = "/usr/share/common-licenses/MPL-2.0"


class BuildError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# --------------------------------------------------------------------------
# Reading .deb packages
# --------------------------------------------------------------------------


def read_ar_members(data: bytes) -> dict[str, bytes]:
    """Return ``{name: content}`` of a Unix ``ar`` archive (the .deb container)."""
    if not data.startswith(b"!<arch>\n"):
        raise BuildError("not a .deb (ar) archive")
    members: dict[str, bytes] = {}
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        start = pos + 60
        members[name] = data[start : start + size]
        pos = start + size + (size % 2)  # members are 2-byte aligned
    return members


def open_deb_tar(deb_path: str, prefix: str) -> tarfile.TarFile:
    """Open the ``control.tar.*`` or ``data.tar.*`` member of a .deb as a TarFile."""
    with open(deb_path, "rb") as f:
        members = read_ar_members(f.read())
    for name, blob in sorted(members.items()):
        if name.startswith(prefix + ".tar"):
            try:
                return tarfile.open(fileobj=io.BytesIO(blob), mode="r:*")
            except tarfile.ReadError:
                break  # e.g. zstd: let dpkg-deb decompress it
    if shutil.which("dpkg-deb") is None:
        raise BuildError(f"cannot read {prefix}.tar in {deb_path} (and dpkg-deb is not installed)")
    flag = "--fsys-tarfile" if prefix == "data" else "--ctrl-tarfile"
    out = subprocess.run(["dpkg-deb", flag, deb_path], check=True, capture_output=True).stdout
    return tarfile.open(fileobj=io.BytesIO(out), mode="r:")


def parse_control(text: str) -> dict[str, str]:
    """Parse a Debian ``control`` file (single stanza) into ``{field: value}``."""
    fields: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line[:1] in (" ", "\t") and key:
            fields[key] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            key = key.strip()
            fields[key] = value.strip()
    return fields


@dataclass
class DebContents:
    """What we need from one help package."""

    package: str
    version: str
    sha256: str
    filename: str
    pages: dict[str, str]  # page path relative to help/<lang>/ -> HTML text
    copyright: str


def load_deb(deb_path: str, lang: str) -> DebContents:
    """Read package metadata, the ``copyright`` file and all HTML pages of ``lang``."""
    if not os.path.isfile(deb_path):
        raise BuildError(f"missing .deb file: {deb_path}")
    with open(deb_path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    with open_deb_tar(deb_path, "control") as tar:
        control = {}
        for m in tar.getmembers():
            if m.isfile() and m.name.lstrip("./") == "control":
                control = parse_control(tar.extractfile(m).read().decode("utf-8"))
    page_prefix = f"{HELP_ROOT}/{lang}/"
    pages: dict[str, str] = {}
    copyright_text = ""
    with open_deb_tar(deb_path, "data") as tar:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            name = m.name[2:] if m.name.startswith("./") else m.name
            if name.startswith(page_prefix) and name.endswith(".html"):
                pages[name[len(page_prefix) :]] = tar.extractfile(m).read().decode("utf-8")
            elif re.fullmatch(r"usr/share/doc/[^/]+/copyright", name):
                copyright_text = tar.extractfile(m).read().decode("utf-8")
    if not pages:
        raise BuildError(f"no help pages for language {lang!r} in {deb_path}")
    return DebContents(
        package=control.get("Package", "?"),
        version=control.get("Version", "?"),
        sha256=sha,
        filename=os.path.basename(deb_path),
        pages=pages,
        copyright=copyright_text,
    )


def apt_download(dest: str) -> tuple[str, str]:
    """Download the two packages with ``apt-get download`` into ``dest``."""
    if shutil.which("apt-get") is None:
        raise BuildError("--en-deb/--de-deb not given and apt-get is not available")
    cmd = ["apt-get", "download", EN_PACKAGE, DE_PACKAGE]
    res = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
    if res.returncode != 0:
        msg = (res.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise BuildError(f"apt-get download failed ({msg}); try 'apt-get update' first")
    found = []
    for pkg in (EN_PACKAGE, DE_PACKAGE):
        matches = sorted(glob.glob(os.path.join(dest, f"{pkg}_*.deb")))
        if not matches:
            raise BuildError(f"apt-get download did not produce {pkg}_*.deb")
        found.append(matches[-1])
    return found[0], found[1]


# --------------------------------------------------------------------------
# Parsing help pages
# --------------------------------------------------------------------------

VOID_TAGS = frozenset("area base br col embed hr img input link meta param source track wbr".split())
CAPTURE_TAGS = frozenset("p h1 h2 h3 h4 h5 h6".split())
INLINE_TAGS = frozenset("a abbr b code em i kbd samp small span strong sub sup u var".split())
SKIP_TAGS = frozenset(("script", "style", "noscript", "title"))
SWITCH_CLASSES = frozenset(("switch", "switchinline"))
EXCLUDED_ID_PREFIXES = ("bm_",)  # empty footer/debug paragraphs (bm_module, bm_system, ...)


def is_hidden(attrs: dict[str, str | None], parent_classes: Sequence[str]) -> bool:
    """True if an element is hidden and its content must be skipped.

    Hidden = ``hidden`` attribute or ``hidden`` class token. Exception: the
    fallback case (``id="default…"``) directly inside a ``switch``/``switchinline``
    container is what the help viewer displays by default, so it is kept.
    """
    classes = (attrs.get("class") or "").split()
    if "hidden" not in attrs and "hidden" not in classes:
        return False
    is_default_case = (attrs.get("id") or "").startswith("default")
    in_switch = any(c in SWITCH_CLASSES for c in parent_classes)
    return not (is_default_case and in_switch)


class _HelpPageParser(html.parser.HTMLParser):
    """Collects the text of ``<p>``/``<h1..6>`` elements that carry an ``id``."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        # Stack of (tag, classes, hidden_or_skipped).
        self.stack: list[tuple[str, list[str], bool]] = []
        self.skip_depth = 0  # number of open hidden/skipped elements
        self.capture_id: str | None = None
        self.capture_level = 0
        self.buffer: list[str] = []
        self.texts: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs_list) -> None:
        attrs = dict(attrs_list)
        if tag in VOID_TAGS:
            if tag == "br" and self.capture_id is not None:
                self.buffer.append(" ")
            return
        parent_classes = self.stack[-1][1] if self.stack else []
        skipped = tag in SKIP_TAGS or is_hidden(attrs, parent_classes)
        classes = (attrs.get("class") or "").split()
        self.stack.append((tag, classes, skipped))
        if skipped:
            self.skip_depth += 1
        if self.capture_id is not None:
            if tag not in INLINE_TAGS:
                self.buffer.append(" ")
            return
        elem_id = attrs.get("id")
        if tag in CAPTURE_TAGS and elem_id and self.skip_depth == 0 and not elem_id.startswith(EXCLUDED_ID_PREFIXES):
            self.capture_id = elem_id
            self.capture_level = len(self.stack)
            self.buffer = []

    def handle_startendtag(self, tag: str, attrs_list) -> None:
        if tag == "br" and self.capture_id is not None:
            self.buffer.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID_TAGS or not any(t == tag for t, _, _ in self.stack):
            return  # stray end tag
        while self.stack:
            open_tag, _, skipped = self.stack.pop()
            if skipped:
                self.skip_depth -= 1
            if self.capture_id is not None and len(self.stack) < self.capture_level:
                self._finish_capture()
            elif self.capture_id is not None and open_tag not in INLINE_TAGS:
                self.buffer.append(" ")
            if open_tag == tag:
                break

    def handle_data(self, data: str) -> None:
        if self.capture_id is not None and self.skip_depth == 0:
            self.buffer.append(data)

    def _finish_capture(self) -> None:
        key = self.capture_id
        n = 2
        while key in self.texts:  # the same id twice on one page (embedded twice)
            key = f"{self.capture_id}#{n}"
            n += 1
        self.texts[key] = normalize_text("".join(self.buffer))
        self.capture_id = None
        self.buffer = []

    def close(self) -> None:
        super().close()
        if self.capture_id is not None:
            self._finish_capture()


def normalize_text(text: str) -> str:
    """NFC-normalise, drop soft hyphens/zero-width characters, collapse whitespace."""
    text = unicodedata.normalize("NFC", text)
    text = re.sub("[\u00ad\u200b\u200c\u200d\u2060\ufeff]", "", text)
    return " ".join(text.split())  # str.split() also splits on NBSP, tabs, newlines


def parse_page(html_text: str) -> dict[str, str]:
    """Parse one help page into ``{element id: normalised visible text}``.

    Only ``<p>`` and ``<h1>``..``<h6>`` elements with an ``id`` are collected
    (``par_id…``, ``hd_id…`` and a few others); hidden content is skipped as
    described in :func:`is_hidden`. Empty texts are kept (as ``""``) so the
    caller can decide; a repeated id gets a ``#2``, ``#3``… suffix.
    """
    parser = _HelpPageParser()
    parser.feed(html_text)
    parser.close()
    return parser.texts


# --------------------------------------------------------------------------
# Pairing and sentence splitting
# --------------------------------------------------------------------------


def pair_paragraphs(en: dict[str, str], de: dict[str, str]) -> list[tuple[str, str]]:
    """Pair texts of one page by id, in English document order; skip empty sides."""
    pairs = []
    for key, en_text in en.items():
        de_text = de.get(key)
        if en_text and de_text:
            pairs.append((en_text, de_text))
    return pairs


# Abbreviations (lower-cased, with trailing dot) after which ". X" is not a
# sentence boundary. Single letters ("z.", "B.", "d.", "h.") and dotted
# sequences ("e.g.", "z.B.", "u.a.") are handled by regexes below.
ABBREVIATIONS = frozenset(
    """
    approx. cf. co. dept. dr. etc. fig. figs. inc. incl. jan. feb. mar. apr. jun.
    jul. aug. sep. sept. oct. nov. dec. ltd. max. min. mr. mrs. ms. no. nos. p.
    pp. resp. st. vs. vol. ver. ca. abb. bd. bspw. bzw. evtl. ggf. gegr. hrsg.
    inkl. jh. kap. nr. sog. str. tab. usw. vgl. zzgl. std. mio. mrd. bsp. ff.
    """.split()
)
_SINGLE_LETTER = re.compile(r"^[^\W\d_]\.$")
_DOTTED = re.compile(r"^(?:[^\W\d_]{1,2}\.){2,}$")  # e.g. i.e. z.B. u.a. d.h. o.ä.
_NUMBER_DOT = re.compile(r"^\d{1,2}\.$")  # German ordinals/dates ("3. Spalte", "31. März")
_BOUNDARY = re.compile(r"([.!?:])[\"'\u201c\u201d\u2019\u00bb\u00ab)\]]*\s+")
_OPENERS = "\"'\u201e\u201c\u00ab\u00bb([\u2018"


def _starts_sentence(rest: str) -> bool:
    """True if ``rest`` starts (after opening quotes/brackets) with a capital or digit."""
    stripped = rest.lstrip(_OPENERS)
    return bool(stripped) and (stripped[0].isupper() or stripped[0].isdigit())


def _is_non_final_dot(text_before: str) -> bool:
    """True if the '.' ending ``text_before`` belongs to an abbreviation/number/ellipsis."""
    if text_before.endswith("..") or text_before.endswith("\u2026"):
        return True  # ellipsis, mostly in menu entries like "Tools - Options..."
    token = text_before.split()[-1].lstrip(_OPENERS) if text_before.split() else ""
    low = token.lower()
    return (
        low in ABBREVIATIONS
        or bool(_SINGLE_LETTER.match(token))
        or bool(_DOTTED.match(token))
        or bool(_NUMBER_DOT.match(token))
    )


def split_sentences(text: str, split_on_colon: bool = SPLIT_ON_COLON) -> list[str]:
    """Split a paragraph into sentences with a simple rule-based splitter.

    A boundary is one of ``. ! ?`` (and ``:`` if ``split_on_colon``; off by
    default, see SPLIT_ON_COLON), optionally
    followed by closing quotes/brackets, then whitespace, then (after optional
    opening quotes/brackets) an upper-case letter or a digit. A ``.`` is *not* a
    boundary after: a known abbreviation (``etc.``, ``Nr.``, ``usw.``, ``vgl.`` …),
    a single letter (``z. B.``, ``d. h.``, initials), a dotted abbreviation
    (``e.g.``, ``i.e.``, ``z.B.``), a one- or two-digit number (``3.``, ``31.``:
    German ordinals and dates; longer numbers such as years do end sentences)
    or an ellipsis (``...``/``…``). Decimals like ``1.5`` never
    match because no whitespace follows the dot. Works the same for English
    and German, so sentence counts are comparable across the two languages.
    """
    sentences = []
    start = 0
    for m in _BOUNDARY.finditer(text):
        punct = m.group(1)
        if punct == ":" and not split_on_colon:
            continue
        if not _starts_sentence(text[m.end() :]):
            continue
        if punct == "." and _is_non_final_dot(text[start : m.start() + 1]):
            continue
        sentence = text[start : m.end()].strip()
        if sentence:
            sentences.append(sentence)
        start = m.end()
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def pair_sentences(
    paragraph_pairs: Iterable[tuple[str, str]], split_on_colon: bool = SPLIT_ON_COLON
) -> Iterator[tuple[str, str]]:
    """Split each paragraph pair into sentences; yield sentence pairs only for
    paragraphs where both sides give the same number of sentences."""
    for en, de in paragraph_pairs:
        en_s = split_sentences(en, split_on_colon)
        de_s = split_sentences(de, split_on_colon)
        if len(en_s) == len(de_s):
            yield from zip(en_s, de_s)


# --------------------------------------------------------------------------
# Filtering and split assignment
# --------------------------------------------------------------------------


def rejection_reason(en: str, de: str) -> str | None:
    """Return why a (normalised) sentence pair is dropped, or None to keep it.

    Rules: empty side; English side without any letter (numbers, symbols);
    more than MAX_WORDS words on either side; character length ratio
    ``(longer + 10) / (shorter + 10) > MAX_LENGTH_RATIO``; identical sides with
    at least MIN_WORDS_UNTRANSLATED words (untranslated text in the German help).
    """
    if not en or not de:
        return "empty"
    if not any(c.isalpha() for c in en):
        return "no_letters"
    if len(en.split()) > MAX_WORDS or len(de.split()) > MAX_WORDS:
        return "too_long"
    lo, hi = sorted((len(en), len(de)))
    if (hi + LENGTH_RATIO_SMOOTHING) / (lo + LENGTH_RATIO_SMOOTHING) > MAX_LENGTH_RATIO:
        return "length_ratio"
    if en == de and len(en.split()) >= MIN_WORDS_UNTRANSLATED:
        return "untranslated"
    return None


def filter_pairs(pairs: Iterable[tuple[str, str]]) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Normalise, deduplicate exact (en, de) pairs (first occurrence wins, order
    kept) and drop outliers. Returns (kept pairs, counts per rejection reason)."""
    seen: set[tuple[str, str]] = set()
    kept: list[tuple[str, str]] = []
    stats: dict[str, int] = {}
    for en, de in pairs:
        en, de = normalize_text(en), normalize_text(de)
        reason = rejection_reason(en, de)
        if reason is None and (en, de) in seen:
            reason = "duplicate"
        if reason is not None:
            stats[reason] = stats.get(reason, 0) + 1
            continue
        seen.add((en, de))
        kept.append((en, de))
    return kept, stats


def assign_split(en: str) -> str:
    """Deterministic split of a pair from its English side only:
    ``int(sha256(en)) % 1000`` in [0, 50) -> valid, [50, 100) -> test, else train."""
    bucket = int.from_bytes(hashlib.sha256(en.encode("utf-8")).digest(), "big") % HASH_MODULUS
    if bucket in VALID_BUCKETS:
        return "valid"
    if bucket in TEST_BUCKETS:
        return "test"
    return "train"


def split_pairs(pairs: Iterable[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Group pairs by :func:`assign_split`, keeping their order."""
    out: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
    for en, de in pairs:
        out[assign_split(en)].append((en, de))
    return out


# --------------------------------------------------------------------------
# Corpus construction from pages
# --------------------------------------------------------------------------


def build_pairs(
    en_pages: dict[str, str], de_pages: dict[str, str], split_on_colon: bool = SPLIT_ON_COLON
) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """From ``{relative page path: html}`` for both languages to filtered sentence
    pairs. Pages are processed in sorted path order; returns (pairs, stats)."""
    common = sorted(set(en_pages) & set(de_pages))
    paragraph_pairs: list[tuple[str, str]] = []
    for path in common:
        paragraph_pairs.extend(pair_paragraphs(parse_page(en_pages[path]), parse_page(de_pages[path])))
    sentence_pairs = list(pair_sentences(paragraph_pairs, split_on_colon))
    kept, stats = filter_pairs(sentence_pairs)
    stats = dict(stats)
    stats.update(
        pages_en=len(en_pages),
        pages_de=len(de_pages),
        pages_common=len(common),
        paragraph_pairs=len(paragraph_pairs),
        sentence_pairs=len(sentence_pairs),
        kept=len(kept),
    )
    return kept, stats


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


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
    return _write_release(out_dir, blobs, readme, license_txt)


def _write_release(out_dir: str, blobs: dict[str, bytes], readme: str, license_txt: str) -> dict[str, str]:
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


# --------------------------------------------------------------------------
# The text-classification corpus: English sentences labelled by application
# --------------------------------------------------------------------------

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
    return _write_release(out_dir, blobs, readme, license_txt)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


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

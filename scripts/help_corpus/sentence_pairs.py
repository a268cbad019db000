"""Sentence pairs from aligned paragraphs: pairing by id, sentence splitting, filters and the split of each pair."""

from __future__ import annotations

import hashlib
import re
from typing import Iterable, Iterator

from help_corpus.pages import normalize_text, parse_page

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

"""Help pages to text: the visible text of every paragraph and heading with an id, hidden content skipped."""

from __future__ import annotations

import html.parser
import re
import unicodedata
from typing import Sequence

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

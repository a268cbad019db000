"""The bundled corpora built from the LibreOffice help packages; scripts/build_corpus.py runs the steps.

debs: reading the two packages; pages: help pages to paragraph texts; sentence_pairs: aligned,
filtered sentence pairs and their splits; release: writing a corpus folder; topics: the English
sentences labelled by application.
"""

"""scripts/make_large_corpus.py: aligned, deterministic joins of bundled pairs."""

import importlib.util
import os

import pytest

_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "make_large_corpus.py")
_spec = importlib.util.spec_from_file_location("make_large_corpus", _SCRIPT)
make_large_corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_large_corpus)


def test_joined_pairs_stay_translations_of_each_other():
    sources, targets = [f"s{i}" for i in range(50)], [f"t{i}" for i in range(50)]
    joined_sources, joined_targets = make_large_corpus.draw_block(sources, targets, 0, 1000, seed=3)
    lengths = set()
    for source, target in zip(joined_sources, joined_targets):
        source_ids = [word[1:] for word in source.split()]
        assert source_ids == [word[1:] for word in target.split()]
        assert all(word[0] == "s" for word in source.split())
        lengths.add(len(source_ids))
    assert lengths == {1, 2, 3}


def test_the_corpus_depends_only_on_the_seed(tmp_path):
    for name in ("a", "b"):
        make_large_corpus.main([f"--out={tmp_path / name}", "--pairs=2500", "--seed=1"])
    for file in ("train.en", "train.de", "valid.en.gz", "test.de.gz"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()
    en, de = ((tmp_path / "a" / f"train.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("en", "de"))
    assert len(en) == len(de) == 2500
    make_large_corpus.main([f"--out={tmp_path / 'c'}", "--pairs=2500", "--seed=2"])
    assert (tmp_path / "c" / "train.en").read_bytes() != (tmp_path / "a" / "train.en").read_bytes()


def test_pairs_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        make_large_corpus.main([f"--out={tmp_path}", "--pairs=0"])

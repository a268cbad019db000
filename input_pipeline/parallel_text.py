"""A TFDS builder for local parallel text: aligned files, one sentence per line.

A folder holds `{split}.{lang}` files (optionally gzipped: `train.en.gz`), e.g.
`train.en` / `train.de`, `valid.en` / `valid.de`, `test.en` / `test.de`. Line i
of the source file translates line i of the target file.

The builder's config name carries a fingerprint of the files' names, sizes and
times, so the dataset is prepared (in ArrayRecord files) once per version of the
files, and later runs read the prepared records without opening the text. Only
before preparing are the files checked (`check_parallel_files`, one streaming
pass): a missing or empty file, differing line counts or bytes that are not
UTF-8 stop the run with a message naming the file, before anything is written.
Every line pair becomes a record, so that an evaluation's output lines up with the
files; a pair with an empty side is counted here, left out of training by the stream
(`streaming.py`) and translated as an empty line.
"""

import dataclasses
import os
from collections.abc import Iterator

import tensorflow_datasets as tfds
from absl import logging

from common.errors import UserInputError
from input_pipeline.local_text import LocalTextBuilder, fingerprint
from input_pipeline.text_lines import decode_line, open_text, read_lines

SPLITS = ("train", "valid", "test")
_BLOCK_BYTES = 16 << 20  # Read at a time by the checks.


def split_file(folder: str, split: str, lang: str) -> str | None:
    """Returns the path of `{split}.{lang}` or `{split}.{lang}.gz`, if present."""
    for name in (f"{split}.{lang}", f"{split}.{lang}.gz"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def _scan(path: str) -> tuple[int, bool]:
    """(number of lines, whether any line holds more than whitespace) of a text file, in blocks.

    Raises:
        UserInputError: if a line is not valid UTF-8, naming the line.
    """
    num_lines, has_text, rest = 0, False, b""
    with open_text(path) as f:
        while block := f.read(_BLOCK_BYTES):
            block = rest + block
            end = block.rfind(b"\n") + 1  # Whole lines only: UTF-8 never spans a '\n'.
            block, rest = block[:end], block[end:]
            num_lines, has_text = _scan_lines(block, path, num_lines, has_text)
    if rest:  # A last line without '\n'.
        num_lines, has_text = _scan_lines(rest, path, num_lines, has_text)
        num_lines += 1
    return num_lines, has_text


def _scan_lines(block: bytes, path: str, lines_before: int, has_text: bool) -> tuple[int, bool]:
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError as e:  # Decode the bad line alone, for its number and message.
        start, end = block.rfind(b"\n", 0, e.start) + 1, block.find(b"\n", e.start)
        line = block[start : end if end >= 0 else len(block)]
        decode_line(line, path, lines_before + block.count(b"\n", 0, start) + 1)
        raise AssertionError(f"{path}: a block failed to decode but its line did not") from e
    return lines_before + block.count(b"\n"), has_text or (bool(text) and not text.isspace())


@dataclasses.dataclass(frozen=True)
class SplitFiles:
    source: str
    target: str
    num_lines: int | None = None  # Known once checked.


def find_parallel_files(
    folder: str, source_lang: str, target_lang: str, required_splits: tuple[str, ...]
) -> dict[str, SplitFiles]:
    """The aligned files of every split present in `folder`, without reading them.

    Raises:
        UserInputError: the folder or a file of a required (or half-present) split is missing.
    """
    if not os.path.isdir(folder):
        raise UserInputError(
            f"Dataset folder {folder} does not exist; set --config.dataset.path to "
            "a folder holding train/valid/test files."
        )
    found = {}
    for split in SPLITS:
        source = split_file(folder, split, source_lang)
        target = split_file(folder, split, target_lang)
        if source is None and target is None and split not in required_splits:
            continue
        for lang, path in ((source_lang, source), (target_lang, target)):
            if path is None:
                raise UserInputError(
                    f"Missing {os.path.join(folder, f'{split}.{lang}')} (or .gz); "
                    f"split '{split}' needs one file per language."
                )
        found[split] = SplitFiles(source, target)
    return found


def check_parallel_files(
    folder: str, source_lang: str, target_lang: str, required_splits: tuple[str, ...]
) -> dict[str, SplitFiles]:
    """Checks the aligned files of every split present in `folder` (reads every line, a block at a time).

    Args:
        folder: the dataset folder.
        source_lang, target_lang: file suffixes, e.g. 'en' and 'de'.
        required_splits: splits that must be present (e.g. ('train', 'valid')).

    Returns:
        {split: SplitFiles with num_lines} for every split with both files present.

    Raises:
        UserInputError: the folder or a required file is missing, a file is empty
            or not UTF-8, or the two sides of a split differ in line count.
    """
    checked = {}
    for split, files in find_parallel_files(folder, source_lang, target_lang, required_splits).items():
        counts = {}
        for path in (files.source, files.target):
            counts[path], has_text = _scan(path)
            if not has_text:
                raise UserInputError(f"{path} is empty; it needs one sentence per line.")
        if counts[files.source] != counts[files.target]:
            raise UserInputError(
                f"{files.source} has {counts[files.source]} lines but {files.target} has "
                f"{counts[files.target]}; line i of one must translate line i of the other."
            )
        checked[split] = dataclasses.replace(files, num_lines=counts[files.source])
    return checked


class ParallelText(LocalTextBuilder):
    """Aligned sentence pairs from local text files, prepared once into ArrayRecord files."""

    VERSION = tfds.core.Version("3.0.0")
    RELEASE_NOTES = {
        "1.0.0": "Initial release.",
        "2.0.0": "Prepared in ArrayRecord files (random access).",
        "3.0.0": "Pairs with an empty side are kept (a record per line), so evaluations line up with the files.",
    }

    def __init__(
        self,
        *,
        path: str,
        source_lang: str,
        target_lang: str,
        required_splits: tuple[str, ...] = ("train",),
        **kwargs,
    ):
        self._folder, self._required_splits = path, required_splits
        self._files = find_parallel_files(path, source_lang, target_lang, required_splits)
        self._source_lang, self._target_lang = source_lang, target_lang
        files = [self._files[split] for split in sorted(self._files)]
        files_hash = fingerprint(side for split_files in files for side in (split_files.source, split_files.target))
        super().__init__(
            config_name=f"{source_lang}-{target_lang}-{files_hash}",
            description=f"Parallel text from {os.path.abspath(path)}",
            **kwargs,
        )

    def download_and_prepare(self, **kwargs) -> None:
        """Prepares the dataset unless a run did before; checks the files first, so that bad ones leave no trace."""
        if not self.data_path.exists():  # TFDS's own test for reusing a prepared dataset.
            check_parallel_files(self._folder, self._source_lang, self._target_lang, self._required_splits)
        super().download_and_prepare(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    self._source_lang: tfds.features.Text(),
                    self._target_lang: tfds.features.Text(),
                }
            ),
            supervised_keys=(self._source_lang, self._target_lang),
            # Keep file order so that hypotheses line up with the user's files.
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download.
        return {split: self._generate_examples(files) for split, files in self._files.items()}

    def _generate_examples(self, files: SplitFiles) -> Iterator[tuple[int, dict]]:
        """Every line pair, stripped, in file order; then counts the pairs with an empty side.

        Raises:
            UserInputError: no pair has text on both sides (after all were written: the split is not kept).
        """
        lines = zip(read_lines(files.source), read_lines(files.target), strict=True)  # Counts checked.
        num_pairs = num_full = 0
        for index, (source, target) in enumerate(lines):
            source, target = source.strip(), target.strip()
            num_pairs, num_full = num_pairs + 1, num_full + bool(source and target)
            yield index, {self._source_lang: source, self._target_lang: target}
        if num_full < num_pairs:
            logging.warning(
                "%s: %d of %d pairs have an empty side; training leaves them out, evaluation translates "
                "an empty source as an empty line.",
                files.source,
                num_pairs - num_full,
                num_pairs,
            )
        if not num_full:
            raise UserInputError(f"{files.source} and {files.target} hold no pair with text on both sides.")

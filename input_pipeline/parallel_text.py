"""A TFDS builder for local parallel text: aligned files, one sentence per line.

A folder holds `{split}.{lang}` files (optionally gzipped: `train.en.gz`), e.g.
`train.en` / `train.de`, `valid.en` / `valid.de`, `test.en` / `test.de`. Line i
of the source file translates line i of the target file.

Files are checked before TFDS prepares anything (`check_parallel_files`): a
missing or empty file, differing line counts or bytes that are not UTF-8 stop
the run with a message naming the file. Pairs with an empty side are skipped
and counted, not fatal.
"""

import dataclasses
import gzip
import hashlib
import os
from collections.abc import Iterator

import tensorflow_datasets as tfds
from absl import logging

from common.errors import UserInputError

SPLITS = ("train", "valid", "test")


def split_file(folder: str, split: str, lang: str) -> str | None:
    """Returns the path of `{split}.{lang}` or `{split}.{lang}.gz`, if present."""
    for name in (f"{split}.{lang}", f"{split}.{lang}.gz"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def read_lines(path: str) -> list[str]:
    """Reads a UTF-8 text file (gzipped if it ends in .gz) into lines.

    Raises:
        UserInputError: if a line is not valid UTF-8, naming the line.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return decode_lines(f.read(), path)


def decode_lines(data: bytes, name: str) -> list[str]:
    """The lines of UTF-8 text, split at '\\n' only (a trailing '\\r' is dropped).

    Args:
        data: the bytes.
        name: what they were read from (a path, 'stdin'), for the error.

    Raises:
        UserInputError: if a line is not valid UTF-8, naming `name` and the line.
    """
    raw_lines = data.split(b"\n")
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()  # The newline that ends the last line.
    lines = []
    for number, raw in enumerate(raw_lines, start=1):
        try:
            lines.append(raw.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError as e:
            raise UserInputError(
                f"{name}, line {number}: bytes that are not UTF-8 ({e.reason} at "
                f"byte {e.start}); convert it, e.g. `iconv -f latin1 -t utf-8`."
            ) from None
    return lines


@dataclasses.dataclass(frozen=True)
class SplitFiles:
    source: str
    target: str
    num_lines: int


def check_parallel_files(
    folder: str, source_lang: str, target_lang: str, required_splits: tuple[str, ...]
) -> dict[str, SplitFiles]:
    """Checks the aligned files of every split present in `folder`.

    Args:
        folder: the dataset folder.
        source_lang, target_lang: file suffixes, e.g. 'en' and 'de'.
        required_splits: splits that must be present (e.g. ('train', 'valid')).

    Returns:
        {split: SplitFiles} for every split with both files present.

    Raises:
        UserInputError: the folder or a required file is missing, a file is empty
            or not UTF-8, or the two sides of a split differ in line count.
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
        source_lines, target_lines = read_lines(source), read_lines(target)
        for path, lines in ((source, source_lines), (target, target_lines)):
            if not any(line.strip() for line in lines):
                raise UserInputError(f"{path} is empty; it needs one sentence per line.")
        if len(source_lines) != len(target_lines):
            raise UserInputError(
                f"{source} has {len(source_lines)} lines but {target} has "
                f"{len(target_lines)}; line i of one must translate line i of the other."
            )
        found[split] = SplitFiles(source, target, len(source_lines))
    return found


def _fingerprint(files: dict[str, SplitFiles]) -> str:
    """A short hash of the files' names, sizes and times: new data, new dataset."""
    digest = hashlib.sha256()
    for split in sorted(files):
        for path in (files[split].source, files[split].target):
            stat = os.stat(path)
            digest.update(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:12]


class ParallelText(tfds.core.GeneratorBasedBuilder):
    """Aligned sentence pairs from local text files."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def __init__(
        self,
        *,
        path: str,
        source_lang: str,
        target_lang: str,
        required_splits: tuple[str, ...] = ("train",),
        **kwargs,
    ):
        self._files = check_parallel_files(path, source_lang, target_lang, required_splits)
        self._source_lang, self._target_lang = source_lang, target_lang
        config = tfds.core.BuilderConfig(
            name=f"{source_lang}-{target_lang}-{_fingerprint(self._files)}",
            description=f"Parallel text from {os.path.abspath(path)}",
        )
        super().__init__(config=config, **kwargs)

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
        sources, targets = read_lines(files.source), read_lines(files.target)
        skipped = 0
        for index, (source, target) in enumerate(zip(sources, targets)):
            source, target = source.strip(), target.strip()
            if not source or not target:
                skipped += 1
                continue
            yield index, {self._source_lang: source, self._target_lang: target}
        if skipped:
            logging.warning("%s: skipped %d of %d pairs with an empty side.", files.source, skipped, len(sources))

"""A TFDS builder for local labelled text: one example per line, `label<TAB>text`.

A folder holds `{split}.tsv` files (optionally gzipped: `train.tsv.gz`), e.g.
`train.tsv`, `valid.tsv`, `test.tsv`. Labels are free strings (`calc`, `pos`).

Files are checked before TFDS prepares anything (`check_labelled_files`): a
missing or empty file, bytes that are not UTF-8, a line without a label and a
tab, or a label of valid/test that never occurs in train stop the run with one
message naming the file and line. Blank lines, and lines with a label but no
text, are skipped and counted. The examples are prepared, as parallel text is, into
ArrayRecord files (`local_text.py`) once per version of the files.
"""

import dataclasses
import os
from collections.abc import Iterator

import tensorflow_datasets as tfds
from absl import logging

from common.errors import UserInputError
from input_pipeline.local_text import LocalTextBuilder, fingerprint
from input_pipeline.parallel_text import SPLITS
from input_pipeline.text_lines import read_lines

SUFFIX = "tsv"
TEXT, LABEL = "text", "label"  # The builder's features.


def split_file(folder: str, split: str) -> str | None:
    """Returns the path of `{split}.tsv` or `{split}.tsv.gz`, if present."""
    for name in (f"{split}.{SUFFIX}", f"{split}.{SUFFIX}.gz"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def parse_line(path: str, number: int, line: str) -> tuple[str, str] | None:
    """(label, text) of one line, None for a line to skip (blank, or no text).

    Raises:
        UserInputError: the line has no tab or an empty label, naming the file and line.
    """
    if not line.strip():
        return None
    label, tab, text = line.partition("\t")
    if not tab or not label.strip():
        raise UserInputError(
            f"{path}, line {number}: expected 'label<TAB>text', got {line[:60]!r}; "
            "separate the label from the text with one tab."
        )
    text = text.strip()
    return (label.strip(), text) if text else None


def read_examples(path: str) -> tuple[list[tuple[str, str, int]], int]:
    """(label, text, line number) of every example of a file, and the number of lines skipped.

    Raises:
        UserInputError: bytes that are not UTF-8 or a malformed line (file and line named).
    """
    examples, skipped = [], 0
    for number, line in enumerate(read_lines(path), start=1):
        parsed = parse_line(path, number, line)
        if parsed is None:
            skipped += 1
        else:
            examples.append((*parsed, number))
    return examples, skipped


def check_labelled_files(folder: str, required_splits: tuple[str, ...]) -> dict[str, str]:
    """Checks the `{split}.tsv[.gz]` files of `folder`.

    Args:
        folder: the dataset folder.
        required_splits: splits that must be present (e.g. ('train', 'valid')).

    Returns:
        {split: path} for every split present.

    Raises:
        UserInputError: the folder or a required file is missing, a file holds no example,
            a line is malformed or not UTF-8, or a valid/test label never occurs in train.
    """
    if not os.path.isdir(folder):
        raise UserInputError(
            f"Dataset folder {folder} does not exist; set --config.dataset.path to a folder holding "
            f"{{train,valid,test}}.{SUFFIX} files of 'label<TAB>text' lines."
        )
    found, examples = {}, {}
    for split in SPLITS:
        path = split_file(folder, split)
        if path is None:
            if split in required_splits:
                raise UserInputError(
                    f"Missing {os.path.join(folder, f'{split}.{SUFFIX}')} (or .gz); "
                    f"split '{split}' needs a file of 'label<TAB>text' lines."
                )
            continue
        examples[split], _ = read_examples(path)
        if not examples[split]:
            raise UserInputError(f"{path} holds no example; it needs 'label<TAB>text' lines.")
        found[split] = path
    if "train" in examples:
        train_labels = {label for label, _, _ in examples["train"]}
        for split, split_examples in examples.items():
            for label, _, number in split_examples:
                if label not in train_labels:
                    raise UserInputError(
                        f"{found[split]}, line {number}: label {label!r} does not occur in {found['train']}; "
                        "a classifier can only predict the labels it was trained on."
                    )
    return found


class LabelledText(LocalTextBuilder):
    """Labelled sentences from local `label<TAB>text` files; features 'text' and 'label' (strings)."""

    VERSION = tfds.core.Version("2.0.0")
    RELEASE_NOTES = {
        "1.0.0": "Initial release.",
        "2.0.0": "Prepared in ArrayRecord files (random access, read without TensorFlow).",
    }

    def __init__(self, *, path: str, required_splits: tuple[str, ...] = ("train",), **kwargs):
        self._files = check_labelled_files(path, required_splits)
        super().__init__(
            config_name=f"tsv-{fingerprint(self._files[split] for split in sorted(self._files))}",
            description=f"Labelled text from {os.path.abspath(path)}",
            **kwargs,
        )

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({TEXT: tfds.features.Text(), LABEL: tfds.features.Text()}),
            supervised_keys=(TEXT, LABEL),
            disable_shuffling=True,  # File order: predictions line up with the user's files.
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download.
        return {split: self._generate_examples(path) for split, path in self._files.items()}

    def _generate_examples(self, path: str) -> Iterator[tuple[int, dict]]:
        examples, skipped = read_examples(path)
        for label, text, number in examples:
            yield number, {TEXT: text, LABEL: label}
        if skipped:
            logging.warning("%s: skipped %d blank lines or lines without text.", path, skipped)


@dataclasses.dataclass(frozen=True)
class LabelledTexts:
    """Sentences and their label names, in the split's order."""

    texts: list[str]
    labels: list[str]

    def __len__(self) -> int:
        return len(self.texts)

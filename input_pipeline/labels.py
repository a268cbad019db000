"""The classes of a classification run: names in class-id order with their training counts, kept in the workdir."""

import collections
import dataclasses
import os

from common import io_errors
from common.errors import UserInputError
from common.workdir import Workdir


@dataclasses.dataclass(frozen=True)
class Labels:
    """The classes of a run: the training labels in class-id order, and how often each occurs in training."""

    names: tuple[str, ...]
    train_counts: tuple[int, ...]

    @property
    def ids(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.names)}

    @property
    def majority(self) -> int:
        """The class id of the most frequent training label (the first of a tie)."""
        return max(range(len(self.names)), key=lambda i: (self.train_counts[i], -i))


def labels_from_training(train_labels: list[str], names: list[str] | None) -> Labels:
    """The classes of a training split: `names` in order if the dataset declares them, else sorted."""
    counts = collections.Counter(train_labels)
    names = list(names) if names is not None else sorted(counts)
    return Labels(tuple(names), tuple(counts.get(name, 0) for name in names))


def save_labels(labels: Labels, workdir: str) -> None:
    path = Workdir(workdir).labels
    with io_errors.naming(path), open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(f"{name}\t{count}\n" for name, count in zip(labels.names, labels.train_counts))
    os.replace(path + ".tmp", path)


def load_labels(workdir: str) -> Labels:
    """The classes saved in <workdir>/labels.tsv.

    Raises:
        UserInputError: the workdir holds no (readable) labels file.
    """
    path = Workdir(workdir).labels
    try:
        with open(path, encoding="utf-8") as f:
            rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
        return Labels(tuple(name for name, _ in rows), tuple(int(count) for _, count in rows))
    except (OSError, ValueError) as e:
        raise UserInputError(
            f"Cannot read the classes of the run from {path} ({type(e).__name__}): {workdir} holds no trained "
            "classifier. Train first with the same --workdir."
        ) from None

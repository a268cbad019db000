"""Classification scores from labels and predictions (NumPy), and the confusion matrix drawn as a figure.

Conventions: class ids 0..num_classes-1; confusion[i, j] counts examples of true class i
predicted as class j (rows: truth, columns: prediction).
"""

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """[num_classes, num_classes] int64 counts: row = true class, column = predicted class."""
    confusion = np.zeros((num_classes, num_classes), np.int64)
    np.add.at(confusion, (np.asarray(labels), np.asarray(predictions)), 1)
    return confusion


def per_class_f1(confusion: np.ndarray) -> np.ndarray:
    """[num_classes] F1 = 2 TP / (2 TP + FP + FN) of each class; 0 for a class never true nor predicted."""
    true_positives = np.diag(confusion).astype(np.float64)
    denominator = confusion.sum(axis=0) + confusion.sum(axis=1)  # (TP + FP) + (TP + FN)
    return np.divide(2 * true_positives, denominator, out=np.zeros_like(true_positives), where=denominator > 0)


def scores(confusion: np.ndarray) -> dict[str, float]:
    """'accuracy' and 'macro_f1' (the unweighted mean of per-class F1 over classes that occur in the split).

    Classes with neither true nor predicted examples do not count towards the mean.
    """
    total = max(int(confusion.sum()), 1)
    present = (confusion.sum(axis=0) + confusion.sum(axis=1)) > 0
    f1 = per_class_f1(confusion)
    return {
        "accuracy": float(np.trace(confusion)) / total,
        "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
    }


def confusion_matrix_figure(confusion: np.ndarray, class_names: list[str], title: str) -> "Figure":
    """A labelled heat map of `confusion`, each row normalised to the share of its true class, counts written in.

    The colour is the row share (recall of the diagonal), so small and large classes read alike;
    the number in each cell is the count.
    """
    num_classes = len(class_names)
    size = 1.2 + 0.75 * num_classes
    # matplotlib only when drawing: training and inference never import it otherwise.
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
    from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

    figure = Figure(figsize=(size + 1.6, size + 0.4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    rows = confusion.sum(axis=1, keepdims=True)
    shares = np.divide(confusion, rows, out=np.zeros(confusion.shape), where=rows > 0)
    image = ax.imshow(shares, cmap="Blues", vmin=0.0, vmax=1.0)
    for i in range(num_classes):
        for j in range(num_classes):
            ax.text(
                j,
                i,
                str(confusion[i, j]),
                ha="center",
                va="center",
                fontsize=9,
                color="white" if shares[i, j] > 0.5 else "black",
            )
    ax.set_xticks(range(num_classes), class_names, rotation=45, ha="right")
    ax.set_yticks(range(num_classes), [f"{name} ({int(rows[i, 0])})" for i, name in enumerate(class_names)])
    ax.set_xlabel("predicted label")
    ax.set_ylabel("true label (examples)")
    ax.set_title(title, fontsize=10)
    figure.colorbar(image, ax=ax, label="share of the true label's examples", shrink=0.8)
    return figure

r"""A bag-of-words linear classifier: the baseline the Transformer classifier has to beat.

  python -m benchmarks.bag_of_words --data=data/libreoffice_help_topics

Reads {train,valid,test}.tsv[.gz] ('label<TAB>text', as the labelled_text dataset),
represents each sentence by the set of its lower-cased words and word bigrams that occur
at least --min_count times in train (L2-normalised binary features), and trains a
multinomial logistic regression (softmax over a linear map; full-batch Adam, L2 penalty)
in JAX. The L2 weight is picked on the validation split from --l2; test accuracy,
macro-F1 and the majority class's accuracy are printed for that choice (and written as
JSON to --output if given).
"""

import collections
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from input_pipeline.labelled_text import read_examples, split_file
from training.tasks import classification_metrics

_DATA = flags.DEFINE_string("data", "data/libreoffice_help_topics", "Folder of {train,valid,test}.tsv[.gz].")
_MIN_COUNT = flags.DEFINE_integer("min_count", 2, "Keep words and bigrams seen at least this often in train.")
_L2 = flags.DEFINE_list(
    "l2", ["0", "1e-7", "1e-6", "1e-5"], "L2 penalties to try (per-example mean loss + l2 * |W|^2)."
)
_STEPS = flags.DEFINE_integer("steps", 300, "Full-batch Adam steps.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 0.05, "Adam learning rate.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the results as JSON here.")

_WORD = re.compile(r"\w+")


def features(text: str) -> set[str]:
    """Lower-cased words and adjacent word pairs of `text`."""
    words = _WORD.findall(text.lower())
    return set(words) | {f"{a} {b}" for a, b in zip(words, words[1:])}


class SparseRows:
    """Rows of L2-normalised binary features: row r has weight values[k] on column columns[k] for rows[k] == r."""

    def __init__(self, texts: list[str], vocabulary: dict[str, int]):
        rows, columns = [], []
        for row, text in enumerate(texts):
            ids = sorted(vocabulary[f] for f in features(text) if f in vocabulary)
            rows += [row] * len(ids)
            columns += ids
        self.rows = np.asarray(rows, np.int32)
        self.columns = np.asarray(columns, np.int32)
        counts = np.bincount(self.rows, minlength=len(texts)).astype(np.float32)
        self.values = (1.0 / np.sqrt(np.maximum(counts, 1.0)))[self.rows]
        self.num_rows = len(texts)


def logits(params, data: SparseRows) -> jax.Array:
    """[num_rows, classes]: sum over each row's features of value * W[feature], plus b."""
    contributions = params["w"][data.columns] * data.values[:, None]
    return jax.ops.segment_sum(contributions, data.rows, num_segments=data.num_rows) + params["b"]


def train(data: SparseRows, labels: np.ndarray, num_features: int, num_classes: int, l2: float) -> dict:
    params = {"w": jnp.zeros((num_features, num_classes)), "b": jnp.zeros(num_classes)}
    tx = optax.adam(_LEARNING_RATE.value)

    def loss(params):
        nll = optax.softmax_cross_entropy_with_integer_labels(logits(params, data), labels).mean()
        return nll + l2 * jnp.sum(params["w"] ** 2)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for _ in range(_STEPS.value):
        params, opt_state = step(params, opt_state)
    return params


def main(argv):
    del argv
    start = time.perf_counter()
    splits = {}
    for split in ("train", "valid", "test"):
        path = split_file(_DATA.value, split)
        if path is None:
            sys.exit(f"error: no {split}.tsv[.gz] in {_DATA.value}")
        examples, _ = read_examples(path)
        splits[split] = ([text for _, text, _ in examples], [label for label, _, _ in examples])
    names = sorted(set(splits["train"][1]))
    label_ids = {name: i for i, name in enumerate(names)}
    counts = collections.Counter(f for text in splits["train"][0] for f in features(text))
    vocabulary = {f: i for i, f in enumerate(sorted(f for f, n in counts.items() if n >= _MIN_COUNT.value))}
    data = {split: SparseRows(texts, vocabulary) for split, (texts, _) in splits.items()}
    labels = {
        split: np.array([label_ids[label] for label in split_labels]) for split, (_, split_labels) in splits.items()
    }
    majority = int(np.bincount(labels["train"]).argmax())

    def evaluate(params, split):
        predictions = np.asarray(jnp.argmax(logits(params, data[split]), axis=-1))
        return classification_metrics.scores(
            classification_metrics.confusion_matrix(labels[split], predictions, len(names))
        )

    best = None
    for l2 in map(float, _L2.value):
        params = train(data["train"], labels["train"], len(vocabulary), len(names), l2)
        valid = evaluate(params, "valid")
        print(f"l2 {l2:g}: valid accuracy {valid['accuracy']:.4f}, macro-F1 {valid['macro_f1']:.4f}")
        if best is None or valid["accuracy"] > best[1]["accuracy"]:
            best = (l2, valid, params)
    l2, valid, params = best
    test = evaluate(params, "test")
    results = {
        "features": len(vocabulary),
        "l2": l2,
        "valid_accuracy": valid["accuracy"],
        "test_accuracy": test["accuracy"],
        "test_macro_f1": test["macro_f1"],
        "test_majority_accuracy": float(np.mean(labels["test"] == majority)),
        "majority_label": names[majority],
        "seconds": time.perf_counter() - start,
    }
    print(
        f"bag of words ({len(vocabulary):,} words and bigrams, l2 {l2:g}): test accuracy {test['accuracy']:.4f}, "
        f"macro-F1 {test['macro_f1']:.4f}; majority class ({names[majority]}) {results['test_majority_accuracy']:.4f}"
    )
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)

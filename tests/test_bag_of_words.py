"""benchmarks/bag_of_words.py, the classification baseline, run as the README runs it, on a tiny corpus.

In a subprocess: the script defines absl flags (--output, ...) that another benchmark imported in the same
test process defines too.
"""

import json
import subprocess
import sys

from conftest import REPO_ROOT


def test_a_corpus_its_words_separate_is_classified_without_error(tmp_path):
    """Each label has its own words: the baseline fits them, and the majority class is the train split's."""
    rows = {
        "train": ["calc\tsum the cells"] * 5 + ["writer\tformat the page"] * 3,
        "valid": ["calc\tthe cells", "writer\tthe page"],
        "test": ["calc\tsum cells", "writer\tformat page", "writer\tthe page"],
    }
    for split, lines in rows.items():
        (tmp_path / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    output = tmp_path / "results.json"
    command = [sys.executable, "-m", "benchmarks.bag_of_words", f"--data={tmp_path}", "--steps=50", "--l2=0"]
    subprocess.run([*command, f"--output={output}"], cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)

    results = json.loads(output.read_text())
    assert results["test_accuracy"] == 1.0 and results["test_macro_f1"] == 1.0
    assert results["majority_label"] == "calc" and results["test_majority_accuracy"] == 1 / 3

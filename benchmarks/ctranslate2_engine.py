r"""CTranslate2 translating a file in a process of its own, as its users run it: the benchmarks' reference engine.

  python -m benchmarks.ctranslate2_engine EXPORT SOURCE TARGET --beam_size=4 --length_penalty=0.6

One Translator a process, importing no JAX: a second Translator in a process slowed the first,
even once deleted (docs/decoding.md#speed), and other libraries' thread pools share the cores.
`translate` runs this module for a benchmark, timing the translation calls alone (tokenizing and
detokenizing outside, where this project's timed calls include them); run as above, it is the
whole process a user of CTranslate2 writes (load the export, translate the file, write the
translations).
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Translations:
    """What `translate` returns: the best hypothesis of each line and the seconds of each round."""

    hypotheses: list[list[str]]  # SentencePiece pieces, without </s>.
    seconds: list[float]  # Each round's translation calls, tokenization outside.
    device: str


def translate(
    export: str,
    lines: Sequence[str],
    budgets: Sequence[int],
    *,
    beam_size: int,
    length_penalty: float,
    max_source_length: int,
    batch_size: int,
    rounds: int = 1,
) -> Translations:
    """Translates `lines` with the CTranslate2 `export` in a process of this module, `rounds` times.

    Each line is decoded at its entry of `budgets` (`max_decoding_length`, </s> included), lines
    of one budget batched together, its source cut to `max_source_length` - 1 pieces (CTranslate2
    adds </s>), as translate.py cuts sources.
    """
    with tempfile.TemporaryDirectory() as scratch:
        paths = {name: os.path.join(scratch, name) for name in ("source", "budgets", "target", "timings")}
        for name, values in (("source", lines), ("budgets", budgets)):
            with open(paths[name], "w", encoding="utf-8") as f:
                f.writelines(f"{value}\n" for value in values)
        command = [sys.executable, "-m", "benchmarks.ctranslate2_engine", export, paths["source"], paths["target"]]
        command += [f"--beam_size={beam_size}", f"--length_penalty={length_penalty}", f"--batch_size={batch_size}"]
        command += [f"--max_source_length={max_source_length}", f"--budgets={paths['budgets']}"]
        command += [f"--rounds={rounds}", f"--timings={paths['timings']}", "--pieces"]
        subprocess.run(command, check=True, cwd=_REPO_ROOT)
        with open(paths["target"], encoding="utf-8", newline="\n") as f:
            hypotheses = [line.split() for line in f.read().split("\n")[:-1]]
        with open(paths["timings"], encoding="utf-8") as f:
            timings = json.load(f)
    return Translations(hypotheses, timings["seconds"], timings["device"])


def budget_groups(budgets: Sequence[int]) -> dict[int, list[int]]:
    """Line indices by their budget: the lines an engine decodes in one call."""
    groups = {}
    for i, budget in enumerate(budgets):
        groups.setdefault(budget, []).append(i)
    return groups


def _translate_file(arguments: argparse.Namespace) -> None:
    import ctranslate2  # pylint: disable=g-import-not-at-top  (the export extra; imported only where it runs)
    import sentencepiece  # pylint: disable=g-import-not-at-top

    device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    threads = {"intra_threads": os.cpu_count()} if device == "cpu" else {}
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(arguments.export, "sentencepiece.model"))
    translator = ctranslate2.Translator(arguments.export, device=device, **threads)
    with open(arguments.source, encoding="utf-8", newline="\n") as f:  # A stray \r stays in its line.
        lines = f.read().split("\n")[:-1]
    cut = arguments.max_source_length - 1 if arguments.max_source_length else None
    pieces = [sp.encode(line.strip(), out_type=str)[:cut] for line in lines]
    if arguments.budgets:
        with open(arguments.budgets, encoding="utf-8") as f:
            budgets = [int(line) for line in f]
        if len(budgets) != len(lines):
            sys.exit(f"error: {arguments.budgets} has {len(budgets)} budgets for {len(lines)} lines")
    else:
        budgets = [arguments.max_decoding_length] * len(lines)
    groups = budget_groups(budgets)
    seconds = []
    for _ in range(arguments.rounds):
        hypotheses = [[] for _ in lines]
        start = time.perf_counter()
        for budget, indices in groups.items():
            results = translator.translate_batch(
                [pieces[i] for i in indices],
                beam_size=arguments.beam_size,
                length_penalty=arguments.length_penalty,
                max_decoding_length=budget,
                min_decoding_length=0,  # As this project's search: </s> may come first.
                max_batch_size=arguments.batch_size,
            )
            for i, result in zip(indices, results):
                hypotheses[i] = result.hypotheses[0]
        seconds.append(time.perf_counter() - start)
    with open(arguments.target, "w", encoding="utf-8") as f:
        join = " ".join if arguments.pieces else sp.decode_pieces
        f.writelines(join(hypothesis) + "\n" for hypothesis in hypotheses)
    if arguments.timings:
        with open(arguments.timings, "w", encoding="utf-8") as f:
            json.dump({"seconds": seconds, "device": device}, f)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("export", help="A CTranslate2 export (export.py --format=ctranslate2).")
    parser.add_argument("source", help="Sentences, one a line.")
    parser.add_argument("target", help="Their translations, one a line (written).")
    parser.add_argument("--beam_size", type=int, default=1)
    parser.add_argument("--length_penalty", type=float, default=0.0)
    parser.add_argument("--batch_size", type=int, default=32, help="Sentences a batch.")
    parser.add_argument("--max_decoding_length", type=int, default=256, help="Every line's budget (no --budgets).")
    parser.add_argument("--budgets", default="", help="A file of each line's budget, one a line.")
    parser.add_argument("--max_source_length", type=int, default=0, help="Sources cut to it, </s> included (0: not).")
    parser.add_argument("--rounds", type=int, default=1, help="Translations of the whole file, timed each.")
    parser.add_argument("--timings", default="", help="A JSON file for each round's seconds (written).")
    parser.add_argument("--pieces", action="store_true", help="Write pieces, space-separated, not text.")
    _translate_file(parser.parse_args(argv))


if __name__ == "__main__":
    main()

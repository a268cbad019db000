#!/usr/bin/env python3
"""Make a WMT-sized parallel corpus from the bundled one, to measure the pipeline at scale.

WMT14 English-German has about 4.5M training pairs; the bundled LibreOffice-help corpus
has 41k. This script writes `--pairs` training pairs, each made of 1 to 3 bundled
training pairs drawn at random and joined with a space on both sides (so lengths vary
as in real data and the pairs stay translations of each other), and copies the valid and
test splits unchanged. The output is a `parallel_text` folder:

    python scripts/make_large_corpus.py --out=runs/large_corpus
    python train.py --config=configs/quickstart.py --workdir=runs/large \\
        --config.dataset.path=runs/large_corpus

With the default 4.5M pairs the two training files hold about 1.2 GB of text. The pairs
depend only on `--seed`; the files are written as they are drawn, a block at a time.
"""

import argparse
import gzip
import os
import shutil
import sys

import numpy as np

_BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "libreoffice_help_en_de")
_BLOCK = 100_000  # Pairs drawn and written at a time.


def read_split(folder: str, split: str, lang: str) -> list[str]:
    """The lines of `{split}.{lang}.gz` in `folder`."""
    with gzip.open(os.path.join(folder, f"{split}.{lang}.gz"), "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def draw_block(
    sources: list[str], targets: list[str], block_index: int, size: int, seed: int, max_joined: int = 3
) -> tuple[list[str], list[str]]:
    """`size` pairs, each the space-joined concatenation of 1..max_joined random pairs.

    A block depends only on (seed, block_index), so any block can be drawn again alone.
    """
    rng = np.random.default_rng([seed, block_index])
    counts = rng.integers(1, max_joined + 1, size=size)
    ends = np.cumsum(counts)
    picks = rng.integers(0, len(sources), size=int(ends[-1]))
    groups = [picks[end - count : end] for end, count in zip(ends, counts)]
    return [" ".join(sources[i] for i in group) for group in groups], [
        " ".join(targets[i] for i in group) for group in groups
    ]


def write_training_files(
    sources: list[str], targets: list[str], out: str, num_pairs: int, seed: int, langs: tuple[str, str]
) -> None:
    """Writes train.{lang} for both languages in `out`, one block of pairs at a time."""
    source_path, target_path = (os.path.join(out, f"train.{lang}") for lang in langs)
    with (
        open(source_path, "w", encoding="utf-8") as source_file,
        open(target_path, "w", encoding="utf-8") as target_file,
    ):
        for block_index, start in enumerate(range(0, num_pairs, _BLOCK)):
            block_sources, block_targets = draw_block(
                sources, targets, block_index, min(_BLOCK, num_pairs - start), seed
            )
            source_file.writelines(line + "\n" for line in block_sources)
            target_file.writelines(line + "\n" for line in block_targets)
            print(f"\r{start + len(block_sources):,} of {num_pairs:,} pairs", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Folder to write (created; existing files are replaced).")
    parser.add_argument("--pairs", type=int, default=4_500_000, help="Training pairs to write.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--source", default=_BUNDLED, help="The bundled corpus folder ({split}.{lang}.gz).")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1.")
    langs = ("en", "de")
    os.makedirs(args.out, exist_ok=True)
    sources, targets = (read_split(args.source, "train", lang) for lang in langs)
    write_training_files(sources, targets, args.out, args.pairs, args.seed, langs)
    for split in ("valid", "test"):
        for lang in langs:
            name = f"{split}.{lang}.gz"
            shutil.copyfile(os.path.join(args.source, name), os.path.join(args.out, name))
    print(f"Wrote {args.pairs:,} training pairs and the bundled valid and test splits to {args.out}.")


if __name__ == "__main__":
    main()

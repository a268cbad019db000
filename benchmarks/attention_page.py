r"""The attention page of a trained model: its size, and a screenshot of it in headless Chromium.

  python -m benchmarks.attention_page --workdir=runs/quickstart --output=docs/results/attention_page_cpu-amx \
      --screenshot=docs/attention_page.png --page=docs/attention_page.html

Runs what a user runs, `translate.py --attention_maps=DIR`, on the first three sentences of the run's
test split, and records the page's bytes. Then what a long sentence costs: the test pair nearest
64 pieces on each side (its reference as the target), alone and twenty times on one page. Last, it
opens the three sentences' page in Debian's chromium (headless, through chromium-driver), shows
cross-attention of the last layer, all heads, with a target piece picked, and saves the screenshot;
the record keeps the page's console errors (none expected).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

from absl import app, flags

from benchmarks.page_browser import choose, click_piece, console_errors, open_chromium, open_page
from common import records
from input_pipeline import parallel_text, text_lines
from input_pipeline.tokenizer import load_tokenizer
from training.reporting import attention_page

records.define_software_note_flag()

_WORKDIR = flags.DEFINE_string("workdir", None, "A trained translation run (the quick-start's).")
_OUTPUT = flags.DEFINE_string("output", None, "Record path without suffix, e.g. docs/results/attention_page_cpu-amx.")
_SCREENSHOT = flags.DEFINE_string("screenshot", None, "Where to save the page's screenshot (PNG).")
_PAGE = flags.DEFINE_string("page", None, "Where to keep a copy of the page of the first sentences.")
_SENTENCES = flags.DEFINE_integer("sentences", 3, "The first N test sentences on the page.")
_PIECES = 64  # The long sentence whose cost is recorded: 64 pieces a side, a yardstick for the page's size.
flags.mark_flags_as_required(["workdir", "output"])


def _translate_with_maps(workdir: str, lines: list[str], out_dir: str) -> str:
    """Runs translate.py --attention_maps=out_dir on `lines`; returns the page's path."""
    command = [sys.executable, "translate.py", f"--workdir={workdir}", f"--attention_maps={out_dir}"]
    result = subprocess.run(
        command, input="\n".join(lines) + "\n", text=True, capture_output=True, cwd=records.REPO_ROOT, check=False
    )
    if result.returncode:
        sys.exit(f"translate.py failed:\n{result.stderr[-3000:]}")
    return os.path.join(out_dir, attention_page.PAGE_FILE)


def _test_pairs(config: dict) -> tuple[list[str], list[str]]:
    """The run's test split: (sources, targets)."""
    dataset = config["dataset"]
    return tuple(
        list(text_lines.read_lines(parallel_text.split_file(dataset["path"], "test", dataset[lang])))
        for lang in ("source_lang", "target_lang")
    )


def main(argv):
    del argv
    source = records.source()
    workdir = _WORKDIR.value
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    sources, references = _test_pairs(config)
    tokenizer = load_tokenizer(os.path.join(workdir, "tokenizer.model"))
    with tempfile.TemporaryDirectory() as folder:
        page = _translate_with_maps(workdir, sources[: _SENTENCES.value], os.path.join(folder, "first"))
        embedded = attention_page.read_attention_page(page)
        if _PAGE.value:
            shutil.copyfile(page, _PAGE.value)
        figures = {
            "sentences": len(embedded),
            "page_bytes": os.path.getsize(page),
            "pieces": [{seq: len(pieces) for seq, pieces in s["pieces"].items()} for s in embedded],
            "levels": attention_page.LEVELS,
        }

        # The test pair nearest 64 pieces on both sides (with <eos>), translated to its reference.
        def distance(i: int) -> int:
            return max(abs(len(tokenizer.encode(text)) + 1 - _PIECES) for text in (sources[i], references[i]))

        nearest = min(range(len(sources)), key=distance)
        pair = f"{sources[nearest]}\t{references[nearest]}"
        one = _translate_with_maps(workdir, [pair], os.path.join(folder, "one"))
        twenty = _translate_with_maps(workdir, [pair] * 20, os.path.join(folder, "twenty"))
        (read,) = attention_page.read_attention_page(one)
        figures["nearest_64"] = {
            "pieces": {seq: len(pieces) for seq, pieces in read["pieces"].items()},
            "page_bytes_one": os.path.getsize(one),
            "page_bytes_twenty": os.path.getsize(twenty),
            "bytes_per_sentence": round((os.path.getsize(twenty) - os.path.getsize(one)) / 19),
            "weights_uncompressed_bytes": sum(w.size for w in read["weights"].values()),
        }
        browser = open_chromium()
        try:
            open_page(browser, page)
            last_layer = max(m["layer"] for m in embedded[0]["maps"] if m["kind"] == "cross_attention")
            choose(browser, "decoder/cross_attention", last_layer, "all", "heatmap")
            target_pieces = embedded[0]["pieces"]["target"]
            click_piece(browser, "target", min(2, len(target_pieces) - 1))
            figures["console_errors"] = console_errors(browser)
            figures["chromium"] = browser.capabilities.get("browserVersion")
            if _SCREENSHOT.value:
                browser.save_screenshot(_SCREENSHOT.value)
        finally:
            browser.quit()
    record = records.new("the attention page's size, and the page in Chromium", figures=figures, **source)
    longest = figures["nearest_64"]
    table = [
        "| page | sentences | pieces (source / target) | bytes |",
        "|---|---:|---|---:|",
        f"| the first {figures['sentences']} test sentences | {figures['sentences']} | "
        + ", ".join(f"{p['source']} / {p['target']}" for p in figures["pieces"])
        + f" | {figures['page_bytes']:,} |",
        f"| the test pair nearest 64 pieces a side | 1 | {longest['pieces']['source']} / "
        f"{longest['pieces']['target']} | {longest['page_bytes_one']:,} |",
        f"| that pair, 20 times | 20 | | {longest['page_bytes_twenty']:,} |",
        "",
        f"Each further sentence of that pair: {longest['bytes_per_sentence']:,} bytes "
        f"({longest['weights_uncompressed_bytes']:,} weights, one byte each, deflated and in base64). "
        f"Weights are rounded to multiples of 1/{figures['levels']}. Chromium {figures['chromium']}: "
        f"{len(figures['console_errors'])} console errors.",
    ]
    print(json.dumps(figures, indent=1))
    print(f"Record: {records.write(record, _OUTPUT.value, table=table)}")


if __name__ == "__main__":
    app.run(main)

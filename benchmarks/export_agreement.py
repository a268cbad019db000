r"""A trained run exported both ways, translating a whole test set: agreement, BLEU and decoding speed.

  python -m benchmarks.export_agreement --workdir=runs/quickstart    # needs the export extra

Exports the run's latest checkpoint with export.py's code to Hugging Face `transformers` and to
CTranslate2 (float32 and int8), then translates every sentence of the test split with each
engine and with this project's own decoding (translate.py's: `inference.translate_lines`),
greedy and with beam 4. For each, against this project's float32 output with the same search:
the share of lines identical, and the detokenized sacreBLEU with its signature; and its speed,
output subwords (with `</s>`) per second over the whole set, the second of two passes for this
project's jitted float32 decoding (the first compiles each length bucket; its 'auto' dtype rows
run once, for agreement only). Beam 4 runs at the run's
length penalty, except Hugging Face, whose penalty divides by length ** alpha where this
project and CTranslate2 use GNMT's ((5 + length) / 6) ** alpha: it is compared at alpha 0,
against this project at alpha 0. Each engine uses the machine's cores (CTranslate2's and
PyTorch's threads: the CPU count). Writes a record (benchmarks/records.py).
"""

import dataclasses
import gzip
import os
import tempfile
import time

import ctranslate2
import sacrebleu
import sentencepiece
import torch
import transformers
from absl import app, flags

from benchmarks import records
from exporting import exporter
from input_pipeline import batching
from models.decoding import decode_length
from training import inference
from training.config_checks import validate_config
from training.reporting.logs import quiet_library_logs
from training.tasks import translation

_WORKDIR = flags.DEFINE_string("workdir", None, "The trained run.", required=True)
_SOURCES = flags.DEFINE_string("sources", "data/libreoffice_help_en_de/test.en.gz", "Source sentences, one a line.")
_REFERENCES = flags.DEFINE_string("references", "data/libreoffice_help_en_de/test.de.gz", "Their references.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Sentences a batch for Hugging Face and CTranslate2.")
_DECODINGS = flags.DEFINE_list(
    "decodings",
    ["greedy", "beam", "beam_alpha_0"],
    "Searches to compare: greedy, beam (the run's alpha), beam_alpha_0.",
)
_OUTPUT = flags.DEFINE_string("output", "", "Record path without suffix (default: export_agreement_<cpu kind>).")
_BEAM_SIZE = 4


@dataclasses.dataclass(frozen=True)
class Decoding:
    beam_size: int
    alpha: float

    @property
    def name(self) -> str:
        return "greedy" if self.beam_size == 1 else f"beam {self.beam_size}, alpha {self.alpha:g}"


def _lines(path: str) -> list[str]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as lines:
        return [line.rstrip("\n") for line in lines]


def _ours(lines: list[str], dtype: str, decoding: Decoding, passes: int) -> tuple[list[str], float | None]:
    """This project's translations (translate.py's decoding) and the last pass's seconds (None: one pass, compiling)."""
    config = inference.load_config(_WORKDIR.value).copy_and_resolve_references()
    config.model.dtype = dtype
    config.eval.beam_size, config.eval.length_penalty = decoding.beam_size, decoding.alpha
    validate_config(config)
    trained = inference.load_trained_model(config, _WORKDIR.value)
    setup = translation.eval_setup(config, trained.model, trained.tokenizer, trained.mesh)
    for _ in range(passes):
        start = time.perf_counter()
        translations = inference.translate_lines(setup, trained.params, lines, config.dataset.max_length)
        seconds = time.perf_counter() - start
    return translations, seconds if passes > 1 else None


def _by_length(lines: list[str], tokenize) -> list[list[int]]:
    """Batches of line indices, the lines sorted by length so that a batch pads little."""
    order = sorted(range(len(lines)), key=lambda i: len(tokenize(lines[i])))
    return [order[i : i + _BATCH_SIZE.value] for i in range(0, len(order), _BATCH_SIZE.value)]


def _huggingface(folder: str, lines: list[str], decoding: Decoding, max_source: int) -> tuple[list[str], float]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    options = {"num_beams": decoding.beam_size}
    if decoding.beam_size > 1:
        options["length_penalty"] = decoding.alpha
    translations = [""] * len(lines)
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in _by_length(lines, tokenizer.tokenize):
            inputs = tokenizer(
                [lines[i] for i in batch], return_tensors="pt", padding=True, truncation=True, max_length=max_source
            )
            outputs = tokenizer.batch_decode(model.generate(**inputs, **options), skip_special_tokens=True)
            for i, output in zip(batch, outputs):
                translations[i] = output
    return translations, time.perf_counter() - start


def _ctranslate2(
    folder: str, lines: list[str], decoding: Decoding, max_source: int, max_length: int
) -> tuple[list[str], float]:
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(folder, "sentencepiece.model"))
    translator = ctranslate2.Translator(folder, device="cpu", intra_threads=os.cpu_count())
    pieces = [sp.encode(line, out_type=str)[: max_source - 1] for line in lines]  # CTranslate2 adds </s>.
    start = time.perf_counter()
    results = translator.translate_batch(
        pieces,
        beam_size=decoding.beam_size,
        length_penalty=decoding.alpha,
        max_batch_size=_BATCH_SIZE.value,
        max_decoding_length=max_length,
    )
    seconds = time.perf_counter() - start
    return [sp.decode(result.hypotheses[0]) for result in results], seconds


def _speed(row: dict) -> str:
    return f"{row['output_subwords_per_second']:,.0f}" if row["output_subwords_per_second"] else "-"


def _our_budgets(lines: list[str], sp, config) -> list[int]:
    """Each line's output budget in this project's decoding: its length bucket's, as translate_ids sets it."""
    lengths = [min(len(sp.encode(line)) + 1, config.dataset.max_length) for line in lines]  # With </s>, cut.
    boundaries = config.dataset.bucket_boundaries
    buckets = batching.bucket_of(lengths, boundaries)
    return [decode_length(boundaries[min(b, len(boundaries) - 1)], config.eval.max_decode_length) for b in buckets]


def _row(engine: str, decoding: Decoding, translations, seconds, reference, references, sp, budgets) -> dict:
    """Agreement with this project's float32 output, BLEU with its signature, output subwords per second.

    A differing line is listed, marked where this project's output ran to its length budget (a
    hypothesis without </s>, cut at its bucket's budget where the other engine's budget is the
    config's max_decode_length): the re-encoded output's length within 2 subwords of the budget.
    """
    bleu = sacrebleu.BLEU()
    score = bleu.corpus_score(translations, [references])
    subwords = sum(len(sp.encode(line)) + 1 for line in translations)  # With </s>.
    differing = [
        {
            "line": i + 1,
            "ours": ours,
            "theirs": theirs,
            "ours_at_length_budget": len(sp.encode(ours)) >= budgets[i] - 2,
        }
        for i, (theirs, ours) in enumerate(zip(translations, reference))
        if theirs != ours
    ]
    row = {
        "engine": engine,
        "decoding": decoding.name,
        "identical_lines": len(translations) - len(differing),
        "lines": len(translations),
        "differing_where_ours_ran_to_its_length_budget": sum(d["ours_at_length_budget"] for d in differing),
        "bleu": score.score,
        "bleu_signature": str(bleu.get_signature()),
        "seconds": seconds,
        "output_subwords_per_second": subwords / seconds if seconds else None,
        "differing_lines": differing,
    }
    print(
        f"{engine:<28} {decoding.name:<20} identical {row['identical_lines']}/{row['lines']} "
        f"({row['differing_where_ours_ran_to_its_length_budget']} others at our budget) BLEU {row['bleu']:.2f} "
        f"{_speed(row)} subwords/s",
        flush=True,
    )
    return row


def main(argv):
    del argv
    quiet_library_logs()
    torch.set_num_threads(os.cpu_count())
    measured_source = records.source()
    lines, references = _lines(_SOURCES.value), _lines(_REFERENCES.value)
    config = inference.load_config(_WORKDIR.value)
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(_WORKDIR.value, "tokenizer.model"))
    greedy = Decoding(1, config.eval.length_penalty)
    beam, beam_alpha_0 = Decoding(_BEAM_SIZE, config.eval.length_penalty), Decoding(_BEAM_SIZE, 0.0)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folders = {}
        for name, export_format, quantization in (
            ("huggingface", "huggingface", None),
            ("ctranslate2", "ctranslate2", None),
            ("ctranslate2_int8", "ctranslate2", "int8"),
        ):
            folders[name] = os.path.join(scratch, name)
            exporter.export_run(_WORKDIR.value, export_format, folders[name], quantization=quantization)
        # Sources cut as translate.py cuts them (dataset.max_length subwords with </s>).
        max_source, max_length = config.dataset.max_length, config.eval.max_decode_length
        budgets = _our_budgets(lines, sp, config)
        searches = {"greedy": greedy, "beam": beam, "beam_alpha_0": beam_alpha_0}
        for decoding in (searches[name] for name in _DECODINGS.value):
            reference, seconds = _ours(lines, "float32", decoding, passes=2)
            runs = {"this project, float32": lambda: (reference, seconds)}
            if decoding is not beam_alpha_0:  # CTranslate2 scores beams with this project's formula.
                runs["this project, 'auto' dtype"] = lambda: _ours(lines, "auto", decoding, passes=1)
                for name in ("ctranslate2", "ctranslate2_int8"):
                    engine = f"CTranslate2, {'int8' if name.endswith('int8') else 'float32'}"
                    runs[engine] = lambda name=name: _ctranslate2(
                        folders[name], lines, decoding, max_source, max_length
                    )
            if decoding is not beam:  # Hugging Face's length penalty is this project's at alpha 0 only.
                runs["Hugging Face, float32"] = lambda: _huggingface(
                    folders["huggingface"], lines, decoding, max_source
                )
            for engine, run in runs.items():
                rows.append(_row(engine, decoding, *run(), reference, references, sp, budgets))
    record = records.new(
        "a trained run exported both ways: agreement, BLEU and speed on a test set",
        figures={"rows": rows},
        packages=(*records.DEFAULT_PACKAGES, "torch", "transformers", "ctranslate2", "sacrebleu"),
        workdir_config=config.to_dict(),
        sources=_SOURCES.value,
        **measured_source,
    )
    table = [
        "| engine | decoding | lines identical to this project's float32 | of the others, ours at its length budget "
        "| BLEU | output subwords/s |",
        "|---|---|---:|---:|---:|---:|",
        *(
            f"| {row['engine']} | {row['decoding']} | {row['identical_lines']:,} / {row['lines']:,} "
            f"({row['identical_lines'] / row['lines']:.2%}) | {row['differing_where_ours_ran_to_its_length_budget']} "
            f"| {row['bleu']:.2f} "
            f"| {_speed(row)} |"
            for row in rows
        ),
        "",
        f"BLEU signature: `{rows[0]['bleu_signature']}`.",
    ]
    path = _OUTPUT.value or os.path.join(records.RESULTS_DIR, f"export_agreement_{record['machine']['cpu_kind']}")
    print("\n".join(table))
    print("wrote", records.write(record, path, table))


if __name__ == "__main__":
    app.run(main)

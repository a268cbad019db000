r"""A trained run exported both ways, translating a whole test set: agreement, BLEU and decoding speed.

  python -m benchmarks.export_agreement --workdir=runs/quickstart    # needs the export extra

Exports the run's latest checkpoint with export.py's code to Hugging Face `transformers` and to
CTranslate2 (float32 and int8), then translates every test sentence with each engine and with
this project's own decoding (translate.py's `inference.translate_lines`), greedy and with beam 4.
Each row gives, against this project's float32 output with the same search, the share of lines
identical and the detokenized sacreBLEU, and its output subwords (with `</s>`) per second (this
project's jitted float32 decoding: the second of two passes, the first compiling; CTranslate2 in a
process of its own, benchmarks/ctranslate2_engine.py).

Each sentence has its own length budget here (`models.decoding.decode_length`); the engines take
one a call. Greedy engines decode at `eval.max_decode_length` and are compared twice: as they
are, and with each output cut to its sentence's budget, which is the output at that budget (a
greedy output's first n tokens do not depend on how many follow). Beam search engines decode
each budget's sentences apart, at that budget. Hugging Face's length penalty divides by
length ** alpha where this project and CTranslate2 use GNMT's ((5 + length) / 6) ** alpha, so its
beam search is compared at alpha 0 only, against this project at alpha 0. Writes a record.
"""

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np
import sacrebleu
import sentencepiece
import torch
import transformers
from absl import app, flags

from benchmarks import ctranslate2_engine
from common import records
from common.special_ids import EOS_ID, PAD_ID
from exporting import exporter
from input_pipeline.text_lines import read_lines
from models.decoding import decode_length
from training import inference
from training.config_checks import validate_config
from training.reporting.logs import quiet_library_logs
from training.tasks import translation_decoding

records.define_software_note_flag()

_WORKDIR = flags.DEFINE_string("workdir", None, "The trained run.", required=True)
_SOURCES = flags.DEFINE_string("sources", "data/libreoffice_help_en_de/test.en.gz", "Source sentences, one a line.")
_REFERENCES = flags.DEFINE_string("references", "data/libreoffice_help_en_de/test.de.gz", "Their references.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Sentences a batch for Hugging Face and CTranslate2.")
_OUTPUT = flags.DEFINE_string("output", "", "Record path without suffix (default: export_agreement_<cpu kind>).")
_BEAM_SIZE = 4


@dataclasses.dataclass(frozen=True)
class Decoding:
    beam_size: int
    alpha: float

    @property
    def name(self) -> str:
        return "greedy" if self.beam_size == 1 else f"beam {self.beam_size}, alpha {self.alpha:g}"


def _ours(lines: list[str], dtype: str, decoding: Decoding, passes: int) -> tuple[list[str], float | None]:
    """This project's translations (translate.py's decoding) and the last pass's seconds (None: one pass, compiling)."""
    config = inference.load_config(_WORKDIR.value).copy_and_resolve_references()
    config.model.dtype = dtype
    config.eval.beam_size, config.eval.length_penalty = decoding.beam_size, decoding.alpha
    validate_config(config)
    trained = inference.load_trained_model(config, _WORKDIR.value)
    translator = translation_decoding.translator(config, trained.model, trained.tokenizer, trained.mesh)
    for _ in range(passes):
        start = time.perf_counter()
        translations = inference.translate_lines(translator, trained.params, lines, config.dataset.max_length)
        seconds = time.perf_counter() - start
    return translations, seconds if passes > 1 else None


def _by_length(indices: list[int], lines: list[str], tokenize) -> list[list[int]]:
    """Batches of the lines at `indices`, sorted by length so that a batch pads little."""
    order = sorted(indices, key=lambda i: len(tokenize(lines[i])))
    return [order[i : i + _BATCH_SIZE.value] for i in range(0, len(order), _BATCH_SIZE.value)]


@dataclasses.dataclass(frozen=True)
class EngineOutput:
    """An engine's translations of every line, as ids without </s>; its detokenizer; the seconds they took."""

    ids: list[list[int]]
    detokenize: Callable[[list[int]], str]
    seconds: float | None

    def texts(self) -> list[str]:
        return [self.detokenize(ids) for ids in self.ids]

    def cut(self, budgets: list[int]) -> "EngineOutput":
        """Each greedy output cut to its sentence's budget: that output at that budget."""
        return dataclasses.replace(self, ids=[ids[:budget] for ids, budget in zip(self.ids, budgets)])


def _call_budgets(budgets: list[int], decoding: Decoding, max_length: int) -> list[int]:
    """Each line's budget in an engine's call: greedy all at max_length (see above), beam search each its own."""
    return [max_length] * len(budgets) if decoding.beam_size == 1 else budgets


def _huggingface(folder: str, lines: list[str], decoding: Decoding, max_source: int, call_budgets) -> EngineOutput:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    options = {"num_beams": decoding.beam_size}
    if decoding.beam_size > 1:
        options["length_penalty"] = decoding.alpha
    translations = [[] for _ in lines]
    start = time.perf_counter()
    with torch.inference_mode():
        for budget, indices in ctranslate2_engine.budget_groups(call_budgets).items():
            for batch in _by_length(indices, lines, tokenizer.tokenize):
                inputs = tokenizer(
                    [lines[i] for i in batch], return_tensors="pt", padding=True, truncation=True, max_length=max_source
                )
                outputs = model.generate(**inputs, **options, max_new_tokens=budget).tolist()
                for i, output in zip(batch, outputs):
                    ids = output[1:]  # After the decoder's start token.
                    translations[i] = ids[: ids.index(EOS_ID)] if EOS_ID in ids else [t for t in ids if t != PAD_ID]
    seconds = time.perf_counter() - start
    return EngineOutput(translations, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), seconds)


def _ctranslate2(folder: str, lines: list[str], decoding: Decoding, max_source: int, call_budgets) -> EngineOutput:
    """CTranslate2 in a process of its own (benchmarks/ctranslate2_engine.py says why)."""
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(folder, "sentencepiece.model"))
    theirs = ctranslate2_engine.translate(
        folder,
        lines,
        call_budgets,
        beam_size=decoding.beam_size,
        length_penalty=decoding.alpha,
        max_source_length=max_source,
        batch_size=_BATCH_SIZE.value,
    )
    translations = [[sp.piece_to_id(piece) for piece in hypothesis] for hypothesis in theirs.hypotheses]
    return EngineOutput(translations, lambda ids: sp.decode_pieces([sp.id_to_piece(i) for i in ids]), theirs.seconds[0])


def _speed(row: dict) -> str:
    return f"{row['output_subwords_per_second']:,.0f}" if row["output_subwords_per_second"] else "-"


def _our_budgets(lines: list[str], sp, config) -> list[int]:
    """Each line's output budget in our decoding: `decode_length` of its source, cut as translate.py cuts it."""
    lengths = [min(len(sp.encode(line.strip())) + 1, config.dataset.max_length) for line in lines]  # With </s>.
    return decode_length(np.array(lengths), config.eval.max_decode_length).tolist()


def _differing(translations: list[str], reference: list[str], sp, budgets: list[int]) -> list[dict]:
    """The lines that differ from ours, each marked where ours ran to its budget (re-encoded within 2 subwords)."""
    return [
        {"line": i + 1, "ours": ours, "theirs": theirs, "ours_at_length_budget": len(sp.encode(ours)) >= budgets[i] - 2}
        for i, (theirs, ours) in enumerate(zip(translations, reference))
        if theirs != ours
    ]


def _row(engine: str, decoding: Decoding, translations, seconds, reference, references, sp, budgets, plain=None):
    """Agreement with this project's float32 output, BLEU with its signature, output subwords per second.

    `plain`: a greedy engine's translations at its one budget (max_decode_length), before they were
    cut to each sentence's; their agreement is recorded beside.
    """
    bleu = sacrebleu.BLEU()
    score = bleu.corpus_score(translations, [references])
    subwords = sum(len(sp.encode(line)) + 1 for line in translations)  # With </s>.
    differing = _differing(translations, reference, sp, budgets)
    row = {
        "engine": engine,
        "decoding": decoding.name,
        "identical_lines": len(translations) - len(differing),
        "lines": len(translations),
        "bleu": score.score,
        "bleu_signature": str(bleu.get_signature()),
        "seconds": seconds,
        "output_subwords_per_second": subwords / seconds if seconds else None,
        "differing_lines": differing,
    }
    if plain is not None:
        differing_plain = _differing(plain, reference, sp, budgets)
        row["one_budget"] = {
            "identical_lines": len(plain) - len(differing_plain),
            "differing_where_ours_ran_to_its_budget": sum(d["ours_at_length_budget"] for d in differing_plain),
            "bleu": sacrebleu.BLEU().corpus_score(plain, [references]).score,
        }
    print(
        f"{engine:<28} {decoding.name:<20} identical {row['identical_lines']}/{row['lines']} "
        f"{_one_budget(row)} BLEU {row['bleu']:.2f} {_speed(row)} subwords/s",
        flush=True,
    )
    return row


def _one_budget(row: dict) -> str:
    plain = row.get("one_budget")
    if plain is None:
        return "-"
    share, at_budget = plain["identical_lines"] / row["lines"], plain["differing_where_ours_ran_to_its_budget"]
    return f"{plain['identical_lines']:,} ({share:.2%}; {at_budget} others at our budget)"


def main(argv):
    del argv
    quiet_library_logs()
    torch.set_num_threads(os.cpu_count())
    measured_source = records.source()
    lines, references = list(read_lines(_SOURCES.value)), list(read_lines(_REFERENCES.value))
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
        for decoding in (greedy, beam, beam_alpha_0):
            call_budgets = _call_budgets(budgets, decoding, max_length)
            reference, seconds = _ours(lines, "float32", decoding, passes=2)
            rows.append(_row("this project, float32", decoding, reference, seconds, reference, references, sp, budgets))
            if decoding is not beam_alpha_0:  # CTranslate2 scores beams with this project's formula.
                auto, _ = _ours(lines, "auto", decoding, passes=1)
                rows.append(
                    _row("this project, 'auto' dtype", decoding, auto, None, reference, references, sp, budgets)
                )
            engines = {}
            if decoding is not beam_alpha_0:
                for name in ("ctranslate2", "ctranslate2_int8"):
                    engine = f"CTranslate2, {'int8' if name.endswith('int8') else 'float32'}"
                    engines[engine] = lambda name=name: _ctranslate2(
                        folders[name], lines, decoding, max_source, call_budgets
                    )
            if decoding is not beam:  # Hugging Face's length penalty is this project's at alpha 0 only.
                engines["Hugging Face, float32"] = lambda: _huggingface(
                    folders["huggingface"], lines, decoding, max_source, call_budgets
                )
            for engine, run in engines.items():
                output = run()
                plain = None
                if decoding.beam_size == 1:
                    plain, output = output.texts(), output.cut(budgets)
                rows.append(
                    _row(engine, decoding, output.texts(), output.seconds, reference, references, sp, budgets, plain)
                )
    record = records.new(
        "a trained run exported both ways: agreement, BLEU and speed on a test set",
        figures={"rows": rows},
        packages=(*records.DEFAULT_PACKAGES, "torch", "transformers", "ctranslate2", "sacrebleu"),
        workdir_config=config.to_dict(),
        sources=_SOURCES.value,
        **measured_source,
    )
    table = [
        "| engine | decoding | lines identical to this project's float32 (each sentence's budget) "
        "| greedy at the engine's one budget (`max_decode_length`) | BLEU | output subwords/s |",
        "|---|---|---:|---:|---:|---:|",
        *(
            f"| {row['engine']} | {row['decoding']} | {row['identical_lines']:,} / {row['lines']:,} "
            f"({row['identical_lines'] / row['lines']:.2%}) | {_one_budget(row)} | {row['bleu']:.2f} | {_speed(row)} |"
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

"""The exported folder's README.md: what the model is, where it comes from, how it scored, how to run it."""

import json
import os

import ml_collections

from common.workdir import Workdir

_USAGE = {
    "huggingface": """```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{path}")
model = AutoModelForSeq2SeqLM.from_pretrained("{path}")
batch = tokenizer(["{example}"], return_tensors="pt", padding=True, truncation=True)
print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))
```""",
    "ctranslate2": """```python
import ctranslate2
import sentencepiece as spm

sp = spm.SentencePieceProcessor(model_file="{path}/sentencepiece.model")
translator = ctranslate2.Translator("{path}")
source = sp.encode("{example}", out_type=str)
results = translator.translate_batch([source], beam_size={beam_size}, max_input_length={max_source_length})
print(sp.decode_pieces(results[0].hypotheses[0]))
```""",
}

_DECODING_NOTES = {
    "huggingface": (
        "`generation_config.json` holds the run's decoding (config.eval). With `num_beams=1` (greedy) "
        "`generate` decodes as `translate.py` does. Beam search ranks hypotheses alike only with "
        "length_penalty 0: `transformers` divides log P by length ** alpha, `translate.py` by GNMT's "
        "((5 + length) / 6) ** alpha."
    ),
    "ctranslate2": (
        "Sources need no added token: the model appends `</s>` itself, as `translate.py` does. "
        "With `beam_size=1` `translate_batch` decodes as `translate.py` does (pass `min_decoding_length=0`: "
        "its default of 1 forbids `</s>` first). Beam search ranks hypotheses alike only with "
        "length_penalty 0: CTranslate2 divides log P by length ** alpha, `translate.py` by GNMT's "
        "((5 + length) / 6) ** alpha."
    ),
}


_LENGTH_NOTE = (
    "Length: `translate.py` gives each translation a budget of its own source (`decode_length` in "
    "aiayn's models/decoding.py, at most {max_decode_length} subwords). {option} is one number a call: a "
    "translation that runs that long without `</s>` is cut elsewhere unless each sentence gets its own."
)
_SOURCE_LENGTH_NOTE = (
    "Long sources: `translate.py` cuts a source longer than {max_source_length} subwords (config.dataset.max_length, "
    "`</s>` included) to its first {max_source_length_without_eos} subwords and `</s>`, with a warning; the model "
    "holds positions for {max_positions} subwords only. {cut}"
)
_SOURCE_CUT = {
    "huggingface": (
        "`truncation=True` cuts as `translate.py` does (the tokenizer's `model_max_length` is {max_source_length}); "
        "without it a longer source goes in whole, and one longer than {max_positions} fails."
    ),
    "ctranslate2": (
        "`max_input_length={max_source_length}` cuts as `translate.py` does (CTranslate2 counts the `</s>` it "
        "appends, and keeps it); with its default, 1024, a source longer than {max_positions} fails (\"No position "
        "encodings are defined for positions >= {max_positions}\")."
    ),
}

_LENGTH_OPTION = {
    "huggingface": "`generate`'s `max_new_tokens` (default: eval.max_decode_length)",
    "ctranslate2": "`translate_batch`'s `max_decoding_length`",
}


def evaluation_scores(workdir: str) -> dict[str, dict]:
    """The scores of each evaluated split (`<workdir>/eval/<split>/scores.json`), by split name."""
    root = Workdir(workdir).evaluations
    scores = {}
    for split in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = Workdir(workdir).scores(split)
        try:
            with open(path, encoding="utf-8") as f:
                scores[split] = json.load(f)
        except (OSError, ValueError):
            continue  # Not evaluated (or unreadable): the card lists what it can read.
    return scores


def _cell(text: str) -> str:
    """`text` inside a Markdown table cell, which a "|" would end even inside backticks."""
    return text.replace("|", "\\|")


def _scores_lines(scores: dict[str, dict]) -> list[str]:
    if not scores:
        return ["No evaluation scores in the workdir (`python train.py --mode=eval ...` writes them)."]
    lines = ["| split | checkpoint | decoding | BLEU | chrF | sacreBLEU signatures |", "|---|---|---|---|---|---|"]
    for split, s in scores.items():
        bleu, chrf = s.get("bleu"), s.get("chrf")
        lines.append(
            f"| {split} | {s.get('checkpoint', '')} | {s.get('decoding', '')} | "
            f"{'' if bleu is None else f'{bleu:.2f}'} | {'' if chrf is None else f'{chrf:.2f}'} | "
            f"`{_cell(s.get('signature', ''))}` `{_cell(s.get('chrf_signature', ''))}` |"
        )
    return lines


def model_card(
    config: ml_collections.ConfigDict,
    *,
    export_format: str,
    architecture: str,
    workdir: str,
    checkpoint: str,
    command: str,
    output: str,
) -> str:
    """The README.md of an exported model.

    Args:
        config: the run's config.
        export_format: 'huggingface' or 'ctranslate2'.
        architecture: what the engine runs it as ('MarianMTModel', 'TransformerSpec', ...).
        workdir: the run's workdir (its scores are read).
        checkpoint: the parameters exported, e.g. 'step 800' or 'average of steps 600, 800'.
        command: the command line that made the export.
        output: the exported folder, for the usage example.
    """
    model, dataset = config.model, config.dataset
    languages = f"{dataset.source_lang}-{dataset.target_lang}"
    header = ["---", f"library_name: {'transformers' if export_format == 'huggingface' else 'ctranslate2'}"]
    header += ["pipeline_tag: translation", "language:", f"- {dataset.source_lang}", f"- {dataset.target_lang}", "---"]
    lengths = {
        "max_source_length": dataset.max_length,
        "max_source_length_without_eos": dataset.max_length - 1,
        "max_positions": model.max_len,
    }
    usage = _USAGE[export_format].format(path=output, example="Click OK.", beam_size=config.eval.beam_size, **lengths)
    layers = f"{model.num_layers}" if model.num_encoder_layers < 0 else f"{model.num_encoder_layers}"
    lines = [
        *header,
        "",
        f"# A {languages} Transformer trained with aiayn, for {export_format}",
        "",
        f"An encoder-decoder Transformer (Vaswani et al., 2017), exported as {architecture}: "
        f"d_model {model.d_model}, {model.num_heads} heads, d_ff {model.d_ff}, {layers} encoder layers, "
        f"{model.norm_placement}-LN, {model.positional_encoding} positions, a shared "
        f"{config.tokenizer.vocab_size}-piece SentencePiece vocabulary.",
        "",
        "## Where it comes from",
        "",
        f"- Training data: `{dataset.name}` {dataset.path}".rstrip(),
        f"- Training steps: {config.num_train_steps}; exported parameters: {checkpoint}",
        f"- Workdir: `{os.path.abspath(workdir)}`",
        f"- Made by: `{command}`",
        "",
        "## Evaluation",
        "",
        *_scores_lines(evaluation_scores(workdir)),
        "",
        "## Use",
        "",
        usage,
        "",
        _DECODING_NOTES[export_format],
        "",
        _SOURCE_LENGTH_NOTE.format(cut=_SOURCE_CUT[export_format].format(**lengths), **lengths),
        "",
        _LENGTH_NOTE.format(max_decode_length=config.eval.max_decode_length, option=_LENGTH_OPTION[export_format]),
        "",
        "## The run's config",
        "",
        "```json",
        config.to_json_best_effort(indent=2, sort_keys=True),
        "```",
        "",
    ]
    return "\n".join(lines)

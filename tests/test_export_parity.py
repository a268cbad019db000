"""Exported models against this project's: the same logits, the same translations, the same token ids.

Two tiny runs are trained through train.py and exported through export.py: the paper's post-LN
with sinusoidal positions (Hugging Face: Marian, its sinusoids reordered) and pre-LN with learned
positions (Hugging Face: Blenderbot, LayerNorm epsilon matched by scaling the residual stream).
CTranslate2 takes both, and untrained models with relative or rotary positions. Where the exported network
and ours disagree, one of them is wrong.
"""

import dataclasses
import functools
import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest
import sentencepiece as spm
from conftest import TINY_MODEL, WITHOUT_TENSORFLOW, run_entry_point

from benchmarks import ctranslate2_engine
from common.special_ids import BOS_ID, EOS_ID, PAD_ID
from common.workdir import Workdir
from exporting.network import network_from_params
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.batching import RaggedIds
from models import Transformer
from models.decoding import decode_batch, decode_length
from models.search import SpecialIds
from models.token_search import TokenSearch, argmax_token
from training import inference
from training.tasks import translation_decoding

ctranslate2 = pytest.importorskip("ctranslate2")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

# float32's unit roundoff.
UNIT_ROUNDOFF = 2.0**-24
# Each logit is the end of a chain of float32 sums, which two implementations order differently. With
# rounding errors that behave like independent ones, a sum of n terms is off by ~sqrt(n) * u relative
# to the sum of its terms' sizes; along the chain the lengths add up: per layer the projections
# (d_model terms each), attention (src_len), the feed-forward layer (d_model, then d_ff), then the
# output layer (d_model). LayerNorm and softmax pass relative errors on with factors of order 1 (the
# trained weights have norms of order 1), so the difference of two correct implementations stays
# within a small multiple of sqrt(n) * u * max|logit|; SAFETY_FACTOR is that multiple (8: the
# random-walk estimate's ~3-sigma spread times the factors above), far below the logit gaps that
# change a decoded token.
SAFETY_FACTOR = 8.0

SENTENCES = 12  # Test sentences compared, the first ones short enough not to be cut (32 subwords).

# Steps of each run, at a peak learning rate of 6e-3 reached after a fifth of them: enough that most greedy outputs
# mix several subwords, not one repeated token (`_check_greedy_results` checks it), where a peak of 3e-3 needed 300.
TRAIN_STEPS = 150


@dataclasses.dataclass(frozen=True)
class Exported:
    """A trained run and its two exports."""

    workdir: str
    huggingface: str
    ctranslate2: str


def _train_and_export(root, corpus: str, name: str, *overrides: str) -> Exported:
    workdir = str(root / name)
    trained = run_entry_point(
        WITHOUT_TENSORFLOW,
        "train.py",
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        f"--config.dataset.path={corpus}",
        f"--config.num_train_steps={TRAIN_STEPS}",
        f"--config.checkpoint_every_steps={TRAIN_STEPS}",
        "--config.eval_every_steps=1000",  # No validation: the test split's evaluation at the end suffices.
        "--config.model.num_layers=2",
        "--config.model.dropout_rate=0",
        "--config.optimizer.peak_learning_rate=6e-3",
        "--config.optimizer.warmup_steps=30",
        *overrides,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    folders = {}
    for export_format in ("huggingface", "ctranslate2"):
        folders[export_format] = str(root / f"{name}_{export_format}")
        exported = run_entry_point(
            "export.py", f"--workdir={workdir}", f"--format={export_format}", f"--output={folders[export_format]}"
        )
        assert exported.returncode == 0, exported.stderr[-3000:]
    return Exported(workdir, **folders)


@pytest.fixture(scope="module", params=["post_sinusoidal", "pre_learned"])
def run(request, small_corpus, tmp_path_factory) -> Exported:
    overrides = {
        "post_sinusoidal": ("--config.model.norm_placement=post", "--config.model.positional_encoding=sinusoidal"),
        "pre_learned": ("--config.model.norm_placement=pre", "--config.model.positional_encoding=learned"),
    }[request.param]
    return _train_and_export(tmp_path_factory.mktemp("export"), small_corpus, request.param, *overrides)


def _on_the_first_run_only(run: Exported) -> None:
    """Skips the test on the second run: it checks export.py's or the benchmarks' handling, whatever the network."""
    if "post" not in os.path.basename(run.workdir):
        pytest.skip("One run is enough.")


@dataclasses.dataclass(frozen=True)
class Ours:
    """This project's side: the trained model, its decoding setups and the test sentences."""

    config: object
    trained: inference.TrainedModel
    sentences: list[str]
    # Translations by (beam_size, length_penalty): each decoding compiles anew, so each runs once.
    translations: dict = dataclasses.field(default_factory=dict)

    def translate_ids(self, beam_size: int = 1, length_penalty: float | None = None) -> list[list[int]]:
        """Our translations' ids (without <eos>), decoded as translate.py decodes: greedy or beam search."""
        key = (beam_size, length_penalty)
        if key not in self.translations:
            self.translations[key] = self._translate_ids(beam_size, length_penalty)
        return self.translations[key]

    def _translate_ids(self, beam_size: int, length_penalty: float | None) -> list[list[int]]:
        config = self.config.copy_and_resolve_references()
        # One bucket: the sentences in one batch, one compiled decoding. Each output has its own
        # sentence's budget whatever batch it is in (translation_decoding.translate_ids).
        config.dataset.bucket_boundaries = (config.dataset.max_length,)
        config.eval.beam_size = beam_size
        if length_penalty is not None:
            config.eval.length_penalty = length_penalty
        trained = self.trained
        translator = translation_decoding.translator(config, trained.model, trained.tokenizer, trained.mesh)
        sources = [trained.tokenizer.encode(s) + [EOS_ID] for s in self.sentences]
        return translation_decoding.translate_ids(translator, trained.params, RaggedIds.from_lists(sources))

    def budgets(self) -> list[int]:
        """Each sentence's output budget in our decoding: `decode_length` of its source, <eos> included."""
        lengths = np.array([len(self.trained.tokenizer.encode(s)) + 1 for s in self.sentences])
        return decode_length(lengths, self.config.eval.max_decode_length).tolist()

    def logits(self, sources: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """Teacher-forced float32 logits [batch, tgt_len, vocab] of padded id batches.

        Computed on the batches padded to the longest source and output (one compiled shape for every
        call): padded keys are masked out of attention and padded targets come after every real one in
        the causal decoder, so padding adds only exact zeros to attention's sums. Longer sums may add in
        another order; the float32 bounds the parity tests derive hold for any order.
        """
        longest_source, longest_target = self.config.dataset.max_length, self.config.eval.max_decode_length + 1
        padded = [
            np.pad(ids, ((0, 0), (0, n - ids.shape[1])), constant_values=PAD_ID)
            for ids, n in ((sources, longest_source), (targets, longest_target))
        ]
        logits = _teacher_forced_logits(self.trained.model, self.trained.params, *padded)
        return np.array(logits[:, : targets.shape[1]])


@functools.partial(jax.jit, static_argnums=0)
def _teacher_forced_logits(model, params, sources, targets):
    return model.apply({"params": params}, sources, targets, deterministic=True)


@pytest.fixture(scope="module")
def ours(run) -> Ours:
    config = inference.load_config(run.workdir)
    trained = inference.load_trained_model(config, run.workdir)
    with open(os.path.join(config.dataset.path, "test.en"), encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    short = [line for line in lines if line and len(trained.tokenizer.encode(line)) < config.dataset.max_length]
    return Ours(config, trained, short[:SENTENCES])


def _padded(rows: list[list[int]]) -> np.ndarray:
    batch = np.full((len(rows), max(map(len, rows))), PAD_ID, np.int32)
    for i, row in enumerate(rows):
        batch[i, : len(row)] = row
    return batch


def _with_eos(rows: list[list[int]]) -> list[list[int]]:
    return [row + [EOS_ID] for row in rows]


def _rounding_tolerance(config, source_length: int, largest_logit: float) -> float:
    """SAFETY_FACTOR * sqrt(n) * u * max|logit|, n the summed lengths of the sums along the chain (see above).

    Args:
        config: the `models.TransformerConfig`.
        source_length: the longest source (attention sums over it).
        largest_logit: max|logit|.
    """
    per_layer = 4 * config.d_model + source_length + config.d_model + config.d_ff  # Encoder or decoder layer, ~.
    if config.positional_encoding == "relative":
        per_layer += config.d_k  # Each score also sums q . a^K over d_k terms (rotary: 2-term rotations only).
    n = (config.num_encoder_layers + config.num_decoder_layers) * per_layer + config.d_model
    return SAFETY_FACTOR * np.sqrt(n) * UNIT_ROUNDOFF * largest_logit


def _generated_ids(row) -> list[int]:
    """Ids after the decoder's start token, up to (not including) the first <eos>."""
    ids = [int(i) for i in row[1:]]
    return ids[: ids.index(EOS_ID)] if EOS_ID in ids else [i for i in ids if i != PAD_ID]


def _cut_to_budgets(outputs: list[list[int]], budgets: list[int]) -> list[list[int]]:
    """Greedy outputs (without <eos>) as a decoding with each sentence's own budget gives them.

    The other engines take one budget a call. A greedy output's first n tokens do not depend on
    how many follow, so an output decoded with a larger budget, cut to a sentence's own, is that
    sentence's output at its own budget.
    """
    return [ids[:budget] for ids, budget in zip(outputs, budgets)]


def _ended(ids: list[int], budget: int) -> list[int]:
    """A hypothesis (without <eos>) with the <eos> it ended on, if it ended before its budget."""
    return ids + [EOS_ID] if len(ids) < budget else ids


def _decided_greedy_tokens(ours: Ours, their_slack: float = 0.0) -> list[int]:
    """How many leading tokens of each of our greedy translations (its <eos> counted) any correct export must choose.

    Greedy decoding takes the argmax of the logits. Our decoder's logits are within `_rounding_tolerance`
    of our teacher-forced ones, the export's within that plus `their_slack` * max|logit|; so on the same
    prefix both pick our teacher-forced argmax wherever it leads the runner-up by more than twice that (the
    two logits may each move by it). From the first closer call on, a correct export may part from us.
    """
    expected = ours.translate_ids()
    sp = ours.trained.tokenizer
    sources = _padded(_with_eos([sp.encode(s) for s in ours.sentences]))
    targets = _padded(_with_eos(expected))
    logits = ours.logits(sources, targets)
    logits[..., [PAD_ID, BOS_ID]] = -np.inf  # Never generated.
    largest = float(np.abs(logits[logits > -np.inf]).max())
    tolerance = _rounding_tolerance(ours.trained.model.config, sources.shape[1], largest) + their_slack * largest
    runner_up, best = np.moveaxis(np.sort(logits, axis=-1)[..., -2:], -1, 0)
    decided = []
    for row, (ids, budget) in enumerate(zip(expected, ours.budgets())):
        chosen = _ended(ids, budget)
        close = np.flatnonzero(best[row, : len(chosen)] - runner_up[row, : len(chosen)] <= 2 * tolerance)
        decided.append(int(close[0]) if close.size else len(chosen))
        # Our decoder chose the teacher-forced argmax wherever it was decided (else one of our two is wrong).
        assert np.argmax(logits[row, : decided[-1]], axis=-1).tolist() == chosen[: decided[-1]], row
    return decided


def _check_greedy_results(ours: Ours, theirs: list[list[int]], engine: str, their_slack: float = 0.0):
    """Their greedy outputs (without <eos>, cut to our budgets) are ours for as long as the arithmetic decides.

    their_slack: how far their logits may be from ours beyond rounding, per unit of max|logit|.
    """
    expected = ours.translate_ids()
    assert sum(len(ids) > 0 for ids in expected) >= len(expected) // 2, "the model translates to nothing"
    assert sum(len(set(ids)) > 1 for ids in expected) >= len(expected) // 2, "the model repeats one token"
    decided = _decided_greedy_tokens(ours, their_slack)
    assert sum(n > 0 for n in decided) >= len(expected) // 2, f"too few tokens decided to compare: {decided}"
    budgets = ours.budgets()
    print(
        f"{engine} greedy: {sum(a == b for a, b in zip(theirs, expected))} of {len(expected)} identical; "
        f"{sum(n == len(_ended(ids, b)) for n, ids, b in zip(decided, expected, budgets))} decided to the end"
    )
    for row, (their_ids, our_ids, budget, n) in enumerate(zip(theirs, expected, budgets, decided)):
        assert _ended(their_ids, budget)[:n] == _ended(our_ids, budget)[:n], (row, n, their_ids, our_ids)


def _by_budget(budgets: list[int]) -> dict[int, list[int]]:
    """Sentence indices by output budget: beam search decodes each group with its own."""
    groups = {}
    for i, budget in enumerate(budgets):
        groups.setdefault(budget, []).append(i)
    return groups


# --------------------------------------------------------------------------- #
# Hugging Face.
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def hf(run):
    # The folder alone: nothing may come from the Hub.
    tokenizer = transformers.AutoTokenizer.from_pretrained(run.huggingface, local_files_only=True)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(run.huggingface, local_files_only=True).eval()
    return tokenizer, model


def test_huggingface_tokenizer_gives_this_projects_ids(hf, ours):
    tokenizer, _ = hf
    batch = tokenizer(ours.sentences, padding=True)
    expected = _with_eos([ours.trained.tokenizer.encode(s) for s in ours.sentences])
    assert batch["input_ids"] == [row + [PAD_ID] * (len(batch["input_ids"][0]) - len(row)) for row in expected]
    assert tokenizer.pad_token_id == PAD_ID and tokenizer.eos_token_id == EOS_ID and tokenizer.bos_token_id == BOS_ID
    for sentence, row in zip(ours.sentences, expected):
        assert tokenizer.decode(row, skip_special_tokens=True) == ours.trained.tokenizer.decode(row[:-1])


@dataclasses.dataclass(frozen=True)
class LogitComparison:
    """Ours and the exported model's teacher-forced logits on our greedy translations, a padded batch."""

    difference: float  # max |theirs - ours| over the ids the decoders may generate.
    largest: float  # max |ours|.
    rounding_tolerance: float
    their_never_generated: np.ndarray  # Their logits of <pad> and <bos>.


def _their_logits(tokenizer, model, sentences: list[str], targets: np.ndarray) -> np.ndarray:
    """The exported model's teacher-forced logits [batch, tgt_len, vocab] of padded target ids (<eos> included)."""
    decoder_inputs = np.concatenate([np.full((len(targets), 1), BOS_ID), targets[:, :-1]], axis=1)
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch, decoder_input_ids=torch.from_numpy(decoder_inputs).long()).logits.numpy()


def _compare_logits(tokenizer, model, ours: Ours) -> LogitComparison:
    sources = _padded(_with_eos([ours.trained.tokenizer.encode(s) for s in ours.sentences]))
    targets = _padded(_with_eos(ours.translate_ids()))
    theirs = _their_logits(tokenizer, model, ours.sentences, targets)
    expected = ours.logits(sources, targets)
    generated = np.setdiff1d(np.arange(expected.shape[-1]), [PAD_ID, BOS_ID])  # The exports add -1e9 to these.
    largest = float(np.abs(expected).max())
    return LogitComparison(
        difference=float(np.abs(theirs[..., generated] - expected[..., generated]).max()),
        largest=largest,
        rounding_tolerance=_rounding_tolerance(ours.trained.model.config, sources.shape[1], largest),
        their_never_generated=theirs[..., [PAD_ID, BOS_ID]],
    )


def _layer_norms(model) -> list:
    return [module for module in model.modules() if isinstance(module, torch.nn.LayerNorm)]


def _smallest_layer_norm_input_variance(tokenizer, model, sentences: list[str], targets: np.ndarray) -> float:
    """The smallest variance of any row a LayerNorm of `model` normalises on these sentences and target ids."""
    smallest = []
    hooks = [
        norm.register_forward_pre_hook(lambda _, args: smallest.append(float(args[0].var(-1, unbiased=False).min())))
        for norm in _layer_norms(model)
    ]
    try:
        _their_logits(tokenizer, model, sentences, targets)
    finally:
        for hook in hooks:
            hook.remove()
    return min(smallest)


def _epsilon_slack(tokenizer, model, ours: Ours, sentences: list[str], targets: np.ndarray) -> float:
    """How far the Hugging Face export's logits may be from ours beyond rounding, per unit of max|logit|.

    Marian's LayerNorms use epsilon 1e-5, ours 1e-6 (exporting/to_huggingface.py): each normalised
    row is off by 1 - sqrt((v + 1e-6) / (v + 1e-5)) <= (1e-5 - 1e-6) / (2 v) relative, for rows of
    variance v; the logits by at most that for each LayerNorm on the way, times max|logit|. The pre-LN
    export (Blenderbot) matches epsilon by scaling the residual stream: 0.

    Args:
        sentences, targets: the inputs it is bounded on: padded target ids, <eos> included.
    """
    if ours.config.model.norm_placement == "pre":
        return 0.0
    variance = _smallest_layer_norm_input_variance(tokenizer, model, sentences, targets)
    return len(_layer_norms(model)) * (1e-5 - 1e-6) / (2 * variance)


def test_huggingface_logits_equal_ours(hf, ours):
    tokenizer, model = hf
    comparison = _compare_logits(tokenizer, model, ours)
    targets = _padded(_with_eos(ours.translate_ids()))
    slack = _epsilon_slack(tokenizer, model, ours, ours.sentences, targets)
    tolerance = comparison.rounding_tolerance + slack * comparison.largest
    print(
        f"huggingface: max |logit difference| {comparison.difference:.3g}, tolerance {tolerance:.3g}, "
        f"max |logit| {comparison.largest:.3g}"
    )
    assert comparison.difference <= tolerance
    assert np.all(comparison.their_never_generated < -1e8)  # Never generated, as in models/search.py.


def test_huggingface_network_is_ours_exactly_with_our_layer_norm_epsilon(hf, ours):
    """With its LayerNorms set to this project's epsilon the exported network is ours up to rounding alone."""
    tokenizer, model = hf
    if ours.config.model.norm_placement == "pre":
        pytest.skip("The pre-LN export already matches epsilon by scaling (see test_huggingface_logits_equal_ours).")
    for norm in _layer_norms(model):
        norm.eps = 1e-6
    try:
        comparison = _compare_logits(tokenizer, model, ours)
    finally:
        for norm in _layer_norms(model):
            norm.eps = 1e-5
    print(
        f"huggingface, epsilon 1e-6: max |logit difference| {comparison.difference:.3g}, "
        f"tolerance {comparison.rounding_tolerance:.3g}"
    )
    assert comparison.difference <= comparison.rounding_tolerance


def test_huggingface_greedy_generate_translates_as_we_do(hf, ours):
    tokenizer, model = hf
    with torch.no_grad():
        output = model.generate(**tokenizer(ours.sentences, return_tensors="pt", padding=True), num_beams=1)
    theirs = _cut_to_budgets([_generated_ids(row) for row in output.tolist()], ours.budgets())
    slack = _epsilon_slack(tokenizer, model, ours, ours.sentences, _padded(_with_eos(ours.translate_ids())))
    _check_greedy_results(ours, theirs, "huggingface", slack)
    # transformers 5 has no "translation" pipeline any more (it points to chat models): decoding is the user's step.
    texts = tokenizer.batch_decode([[BOS_ID, *ids] for ids in theirs], skip_special_tokens=True)
    assert texts == [ours.trained.tokenizer.decode(ids) for ids in theirs]


@dataclasses.dataclass(frozen=True)
class Scored:
    """Hypotheses of some of the sentences, scored by our model, and how far another float32 computation may be."""

    log_probs: np.ndarray  # [n] log P(ids), <eos> counted where the hypothesis has one.
    lengths: np.ndarray  # [n] tokens, <eos> counted.
    rounding: np.ndarray  # [n] the most another float32 computation of log_probs may differ by.
    largest: float  # max|logit| over the ids that may be generated.

    def gnmt_scores(self, alpha: float) -> np.ndarray:
        """Our ranking: log P / ((5 + |Y|) / 6) ** alpha, |Y| counting <eos> (models/beam_search.py)."""
        return self.log_probs / ((5 + self.lengths) / 6) ** alpha


def _scored(ours: Ours, rows: list[int], hypotheses: list[list[int]]) -> Scored:
    """Hypothesis i of sentence rows[i] (without <eos>; those that reach their budget have none) under our model.

    Each log-probability is within twice the logits' rounding of another computation's (as in
    test_ctranslate2_scores_equal_ours); summing |ids| of them in float32 adds at most |ids| * u * |log P| to
    each side.
    """
    sp = ours.trained.tokenizer
    budgets = ours.budgets()
    finished = [_ended(ids, budgets[row]) for row, ids in zip(rows, hypotheses)]
    sources = _padded([sp.encode(ours.sentences[row]) + [EOS_ID] for row in rows])
    targets = _padded(finished)
    logits = ours.logits(sources, targets)
    logits[..., [PAD_ID, BOS_ID]] = -1e9
    log_probs = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), targets[..., None], axis=-1)[..., 0]
    lengths = np.array([len(ids) for ids in finished])
    log_probs = np.where(np.arange(targets.shape[1]) < lengths[:, None], log_probs, 0.0).sum(axis=1)
    largest = float(np.abs(logits[logits > -1e8]).max())
    per_token = 2 * _rounding_tolerance(ours.trained.model.config, sources.shape[1], largest)
    return Scored(log_probs, lengths, lengths * (per_token + 2 * UNIT_ROUNDOFF * np.abs(log_probs)), largest)


def _check_beam_results(
    ours: Ours,
    theirs: list[list[int]],
    their_log_probs: np.ndarray,
    expected: list[list[int]],
    alpha: float,
    engine: str,
    their_slack: float = 0.0,
):
    """What the arithmetic decides about two beam searches over one network: their scores, not their beams.

    1. The other engine's own log P of each hypothesis it returns (`their_log_probs`) is our model's within
       rounding, and `their_slack` (per unit of max|logit|, twice that per log-probability) where their
       network differs by design: it scored the paths it searched as ours does (a wrong export would not).
    2. Ours scores at least as well as theirs under our ranking (`Scored.gnmt_scores`), within the rounding
       of two computations of both scores. Both searches keep as live the best beam_size extensions by log P
       that do not end in <eos>, among the best 2 * beam_size; transformers and CTranslate2 finish an <eos>
       extension only when it ranks among the best beam_size, we among all 2 * beam_size, and we stop only
       when no live hypothesis can still beat our beam_size-th finished one (CTranslate2 stops at beam_size
       finished ones, and ranks them by log P / |Y| ** alpha). So our finished candidates include theirs,
       and our best is at least their choice under our ranking. That holds while both keep the same live
       hypotheses: two extensions tied within rounding at the edge of the beam could break it, the one
       premise here the arithmetic does not decide (a rare one: the engines' actual differences, printed,
       are far below the tolerances, and two candidates must tie within them to swap).

    Which beams part, and how many, is not decided by the arithmetic: it follows from the engines' different
    pruning, on each sentence's logits, so it is reported, not bounded.
    """
    rows = list(range(len(expected)))
    their_scored = _scored(ours, rows, theirs)
    our_scored = _scored(ours, rows, expected)
    parted = [i for i in rows if theirs[i] != expected[i]]
    tolerance = their_scored.rounding + their_scored.lengths * 2 * their_slack * their_scored.largest
    print(
        f"{engine} beam 4, alpha {alpha}: {len(rows) - len(parted)} of {len(rows)} identical; "
        f"max |their log P - ours| {np.abs(their_log_probs - their_scored.log_probs).max():.3g}, "
        f"tolerance {tolerance.min():.3g} to {tolerance.max():.3g}"
    )
    for i in rows:
        assert abs(their_log_probs[i] - their_scored.log_probs[i]) <= tolerance[i], (i, theirs[i])
    our_scores, their_scores = our_scored.gnmt_scores(alpha), their_scored.gnmt_scores(alpha)
    for i in parted:  # lp >= 1: dividing by it only shrinks the rounding.
        assert our_scores[i] >= their_scores[i] - our_scored.rounding[i] - their_scored.rounding[i], (
            i,
            theirs[i],
            expected[i],
        )


def test_huggingface_beam_search_without_length_penalty_translates_as_we_do(hf, ours):
    """transformers divides log P by length ** alpha, we by ((5 + length) / 6) ** alpha: the same only at alpha 0."""
    tokenizer, model = hf
    theirs = [None] * len(ours.sentences)
    their_log_probs = np.zeros(len(ours.sentences))
    for budget, rows in _by_budget(ours.budgets()).items():
        batch = tokenizer([ours.sentences[i] for i in rows], return_tensors="pt", padding=True)
        with torch.no_grad():
            output = model.generate(
                **batch,
                num_beams=4,
                length_penalty=0.0,
                max_new_tokens=budget,
                output_scores=True,
                return_dict_in_generate=True,
            )
        for i, row, score in zip(rows, output.sequences.tolist(), output.sequences_scores.tolist()):
            theirs[i], their_log_probs[i] = _generated_ids(row), score  # At alpha 0 the score is log P.
    expected = ours.translate_ids(beam_size=4, length_penalty=0.0)
    their_targets = _padded([_ended(ids, budget) for ids, budget in zip(theirs, ours.budgets())])
    slack = _epsilon_slack(tokenizer, model, ours, ours.sentences, their_targets)
    _check_beam_results(ours, theirs, their_log_probs, expected, 0.0, "huggingface", slack)


# --------------------------------------------------------------------------- #
# CTranslate2.
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def translator(run):
    return ctranslate2.Translator(run.ctranslate2, device="cpu")


@pytest.fixture(scope="module")
def pieces(run, ours) -> list[list[str]]:
    """The sentences as the exported folder's own SentencePiece model splits them, nothing added."""
    sp = spm.SentencePieceProcessor(model_file=os.path.join(run.ctranslate2, "sentencepiece.model"))
    return [sp.encode(s, out_type=str) for s in ours.sentences]


def test_ctranslate2_scores_equal_ours(translator, pieces, ours):
    expected_ids = ours.translate_ids()
    sp = ours.trained.tokenizer
    results = translator.score_batch(pieces, [[sp.id_to_piece(i) for i in ids] for ids in expected_ids])
    sources = _padded(_with_eos([sp.encode(s) for s in ours.sentences]))
    targets = _padded(_with_eos(expected_ids))
    logits = ours.logits(sources, targets)
    logits[..., [PAD_ID, BOS_ID]] = -1e9  # As models/search.py, and the export's output bias.
    log_probs = np.asarray(jax.nn.log_softmax(logits))
    difference = 0.0
    for row, (result, ids) in enumerate(zip(results, _with_eos(expected_ids))):
        expected = log_probs[row, np.arange(len(ids)), ids]
        assert len(result.log_probs) == len(ids)  # One per target token, <eos> included.
        difference = max(difference, float(np.abs(np.asarray(result.log_probs) - expected).max()))
    # A log-probability is a logit minus log-sum-exp of the row: twice the logits' rounding at most.
    tolerance = 2 * _rounding_tolerance(
        ours.trained.model.config, sources.shape[1], float(np.abs(logits[logits > -1e8]).max())
    )
    print(f"ctranslate2: max |log-probability difference| {difference:.3g}, tolerance {tolerance:.3g}")
    assert difference <= tolerance


def test_ctranslate2_greedy_translates_as_we_do(translator, pieces, ours):
    results = translator.translate_batch(
        pieces, beam_size=1, max_decoding_length=ours.config.eval.max_decode_length, min_decoding_length=0
    )
    sp = ours.trained.tokenizer
    theirs = [[sp.piece_to_id(p) for p in r.hypotheses[0]] for r in results]
    _check_greedy_results(ours, _cut_to_budgets(theirs, ours.budgets()), "ctranslate2")


def test_the_benchmarks_ctranslate2_process_translates_as_the_translator_does(run, translator, pieces, ours, tmp_path):
    """benchmarks/ctranslate2_engine.py as decode_speed runs it (pieces, rounds) and as a whole process (text)."""
    _on_the_first_run_only(run)
    budgets = ours.budgets()
    theirs = ctranslate2_engine.translate(
        run.ctranslate2,
        ours.sentences,
        budgets,
        beam_size=2,
        length_penalty=0.6,
        max_source_length=ours.config.dataset.max_length,
        batch_size=4,
        rounds=2,
    )
    cut = [p[: ours.config.dataset.max_length - 1] for p in pieces]  # As translate.py cuts sources, </s> added.
    expected = [None] * len(pieces)
    for budget, rows in _by_budget(budgets).items():
        results = translator.translate_batch(
            [cut[i] for i in rows],
            beam_size=2,
            length_penalty=0.6,
            max_decoding_length=budget,
            min_decoding_length=0,
        )
        for i, result in zip(rows, results):
            expected[i] = result.hypotheses[0]
    assert theirs.hypotheses == expected
    assert len(theirs.seconds) == 2 and min(theirs.seconds) > 0 and theirs.device == "cpu"

    source, target = tmp_path / "source.txt", tmp_path / "target.txt"
    source.write_text("".join(s + "\n" for s in ours.sentences), encoding="utf-8")
    command = ["-m", "benchmarks.ctranslate2_engine", run.ctranslate2, str(source), str(target), "--beam_size=2"]
    result = run_entry_point(*command, "--length_penalty=0.6", f"--max_decoding_length={max(budgets)}")
    assert result.returncode == 0, result.stderr[-3000:]
    results = translator.translate_batch(
        pieces, beam_size=2, length_penalty=0.6, max_decoding_length=max(budgets), min_decoding_length=0
    )
    sp = spm.SentencePieceProcessor(model_file=os.path.join(run.ctranslate2, "sentencepiece.model"))
    expected_text = "".join(sp.decode_pieces(r.hypotheses[0]) + "\n" for r in results)
    assert target.read_text(encoding="utf-8") == expected_text


def test_ctranslate2_beam_search_with_the_runs_length_penalty_translates_as_we_do(translator, pieces, ours):
    """CTranslate2 ranks by log P / |Y| ** alpha, we by log P / ((5 + |Y|) / 6) ** alpha, <eos> in |Y| in both."""
    alpha = ours.config.eval.length_penalty
    sp = ours.trained.tokenizer
    theirs = [None] * len(pieces)
    their_log_probs = np.zeros(len(pieces))
    for budget, rows in _by_budget(ours.budgets()).items():
        results = translator.translate_batch(
            [pieces[i] for i in rows],
            beam_size=4,
            length_penalty=alpha,
            max_decoding_length=budget,
            min_decoding_length=0,  # As ours: <eos> may come first (CTranslate2's default forbids it there).
            return_scores=True,
        )
        for i, result in zip(rows, results):
            theirs[i] = [sp.piece_to_id(p) for p in result.hypotheses[0]]
            their_log_probs[i] = result.scores[0] * len(_ended(theirs[i], budget)) ** alpha
    _check_beam_results(ours, theirs, their_log_probs, ours.translate_ids(beam_size=4), alpha, "ctranslate2")


# --------------------------------------------------------------------------- #
# A source longer than the positions table: translate.py cuts it to dataset.max_length, the engines as the card says.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class OverLong:
    """One line longer than the exported positions table, and what translate.py makes of it."""

    line: str
    cut_ids: list[int]  # The source ids translate.py feeds its encoder: dataset.max_length, <eos> last.
    translation: str  # translate.py's greedy translation.
    budget: int  # Its output budget: decode_length of the cut source.


@pytest.fixture(scope="module")
def over_long(ours) -> OverLong:
    config = ours.config.copy_and_resolve_references()
    config.eval.beam_size = 1
    with open(os.path.join(config.dataset.path, "test.en"), encoding="utf-8") as f:
        line = " ".join(line.strip() for line in f)
    sp = ours.trained.tokenizer
    assert len(sp.encode(line)) + 1 > ours.trained.model.config.max_len  # Whole, it fails in both engines.
    cut, _ = tokenizer_lib.encode_sources(sp, [line], config.dataset.max_length)
    translator = translation_decoding.translator(config, ours.trained.model, sp, ours.trained.mesh)
    # What translate.py runs: inference.translate_lines with the run's dataset.max_length.
    [text] = inference.translate_lines(translator, ours.trained.params, [line], config.dataset.max_length)
    assert text, "the model translates the line to nothing"
    budget = decode_length(config.dataset.max_length, config.eval.max_decode_length)
    return OverLong(line, cut[0].tolist(), text, budget)


def _model_card(folder: str) -> str:
    with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_huggingface_cuts_an_over_long_source_as_translate_py_does(run, hf, ours, over_long):
    tokenizer, model = hf
    assert 'tokenizer(["Click OK."], return_tensors="pt", padding=True, truncation=True)' in _model_card(
        run.huggingface
    )
    batch = tokenizer([over_long.line], return_tensors="pt", padding=True, truncation=True)
    assert batch["input_ids"][0].tolist() == over_long.cut_ids
    with torch.no_grad():
        output = model.generate(**batch, num_beams=1, max_new_tokens=over_long.budget)
    assert tokenizer.batch_decode(output, skip_special_tokens=True) == [over_long.translation]


def test_ctranslate2_cuts_an_over_long_source_as_translate_py_does(run, translator, ours, over_long):
    max_length = ours.config.dataset.max_length
    assert f"max_input_length={max_length})" in _model_card(run.ctranslate2)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(run.ctranslate2, "sentencepiece.model"))
    [result] = translator.translate_batch(
        [sp.encode(over_long.line, out_type=str)],
        beam_size=1,
        max_input_length=max_length,
        max_decoding_length=over_long.budget,
    )
    assert sp.decode(result.hypotheses[0]) == over_long.translation


# --------------------------------------------------------------------------- #
# The folders.
# --------------------------------------------------------------------------- #


def test_the_model_card_names_the_config_checkpoint_scores_and_command(run):
    with open(Workdir(run.workdir).scores("test"), encoding="utf-8") as f:
        scores = json.load(f)
    for export_format in ("huggingface", "ctranslate2"):
        output = getattr(run, export_format)
        with open(os.path.join(output, "README.md"), encoding="utf-8") as f:
            card = f.read()
        assert f"Training steps: {TRAIN_STEPS}; exported parameters: step {TRAIN_STEPS}" in card
        assert f"| test | step {TRAIN_STEPS} | greedy | {scores['bleu']:.2f} | {scores['chrf']:.2f} |" in card
        assert scores["signature"].replace("|", "\\|") in card
        assert f"python export.py --workdir={run.workdir} --format={export_format} --output={output}" in card
        assert '"norm_placement": "' in card and f'"num_train_steps": {TRAIN_STEPS}' in card


def test_export_refuses_a_non_empty_output_unless_told_to_overwrite(run, tmp_path):
    _on_the_first_run_only(run)
    output = tmp_path / "exported"
    output.mkdir()
    (output / "notes.txt").write_text("mine", encoding="utf-8")
    args = ("export.py", f"--workdir={run.workdir}", "--format=ctranslate2", f"--output={output}")
    refused = run_entry_point(*args)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        f"error: --output={output} exists and is not empty; pass --overwrite to replace it."
    )
    assert os.listdir(output) == ["notes.txt"]
    replaced = run_entry_point(*args, "--overwrite", "--quantization=int8")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert sorted(os.listdir(output)) == [
        "README.md",
        "config.json",
        "model.bin",
        "sentencepiece.model",
        "shared_vocabulary.json",
    ]
    assert sorted(os.listdir(tmp_path)) == ["exported"]


# Runs export.py with its engine's weights writer failing as on a full disk, partway through the file: safetensors
# with the error its Rust writer raised on a full tmpfs, CTranslate2 with Python's `OSError` from a buffered write
# (which names no file).
_EXPORT_ON_A_FULL_DISK = """
import errno, os, runpy, sys
import safetensors.torch
from ctranslate2.specs import model_spec

def _half_written(path):
    with open(path, "wb") as f:
        f.write(b"half")

def _safetensors_on_a_full_disk(tensors, filename, metadata=None):
    _half_written(filename)
    raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

def _ctranslate2_on_a_full_disk(spec, path):
    _half_written(path)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

safetensors.torch.serialize_file = _safetensors_on_a_full_disk
model_spec.ModelSpec._serialize = _ctranslate2_on_a_full_disk
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("export_format", ["huggingface", "ctranslate2"])
def test_a_full_disk_is_one_error_line_and_leaves_nothing(run, tmp_path, export_format):
    _on_the_first_run_only(run)
    output = tmp_path / "exported"
    args = (f"--workdir={run.workdir}", f"--format={export_format}", f"--output={output}")
    result = run_entry_point("-c", _EXPORT_ON_A_FULL_DISK, "export.py", *args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: cannot write in {output}: No space left on device (errno 28); free space on that disk or write "
        "elsewhere"
    ]
    assert result.stderr.strip().splitlines()[-1].startswith("error:")
    assert os.listdir(tmp_path) == []  # No output folder, and no staging folder beside it.


# --------------------------------------------------------------------------- #
# CTranslate2 with what only it holds (relative or rotary positions, untied embeddings): untrained models.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "fields",
    [
        {"positional_encoding": "relative"},
        {"positional_encoding": "relative", "relative_values": True},
        {"positional_encoding": "rotary"},
        {"positional_encoding": "sinusoidal", "norm_placement": "post", "tie_embeddings": False},
    ],
    ids=["relative_keys", "relative_keys_and_values", "rotary", "untied_embeddings"],
)
def test_ctranslate2_untrained_models_score_and_decode_as_ours(tmp_path, fields):
    """Shaw et al.'s tables (over sequences longer than the clip, 3) or rotations in every self-attention.

    And untied embeddings: source, target and output matrices of their own, which only CTranslate2 holds.
    """
    from exporting import to_ctranslate2  # After importorskip: it imports ctranslate2.

    config = dataclasses.replace(
        TINY_MODEL, **{"vocab_size": 40, "max_len": 32, "norm_placement": "pre", "relative_clip": 3, **fields}
    )
    model = Transformer(config)
    rng = np.random.default_rng(0)
    sources = [list(rng.integers(4, config.vocab_size, length)) for length in (12, 5, 9)]
    targets = [list(rng.integers(4, config.vocab_size, length)) for length in (4, 11, 7)]
    params = nn.unbox(
        model.init(jax.random.PRNGKey(0), _padded(sources), _padded(targets), deterministic=True)["params"]
    )
    pieces = ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(4, config.vocab_size)]
    to_ctranslate2.save(to_ctranslate2.transformer_spec_of(network_from_params(config, params), pieces), str(tmp_path))
    translator = ctranslate2.Translator(str(tmp_path))
    source_pieces = [[pieces[i] for i in row] for row in sources]
    results = translator.score_batch(source_pieces, [[pieces[i] for i in row] for row in targets])
    logits = np.array(_teacher_forced_logits(model, params, _padded(_with_eos(sources)), _padded(_with_eos(targets))))
    logits[..., [PAD_ID, BOS_ID]] = -1e9
    log_probs = np.asarray(jax.nn.log_softmax(logits))
    difference = max(
        float(np.abs(np.asarray(result.log_probs) - log_probs[row, np.arange(len(ids)), ids]).max())
        for row, (result, ids) in enumerate(zip(results, _with_eos(targets)))
    )
    longest_source = _padded(_with_eos(sources)).shape[1]
    tolerance = 2 * _rounding_tolerance(config, longest_source, float(np.abs(logits[logits > -1e8]).max()))
    print(f"ctranslate2, {fields}: max |log-probability difference| {difference:.3g}, tolerance {tolerance:.3g}")
    assert difference <= tolerance
    # Greedy decoding runs the decoder a position at a time on cached keys (rotated ones, with rotary).
    greedy = TokenSearch(argmax_token, SpecialIds(bos=BOS_ID, eos=EOS_ID, pad=PAD_ID))
    ours = greedy.best(decode_batch(greedy, model, params, _padded(_with_eos(sources)), max_length=12))
    theirs = translator.translate_batch(source_pieces, beam_size=1, max_decoding_length=12)
    assert all(len(r.hypotheses[0]) >= 3 for r in theirs)  # Long enough to see positions 0, 1, 2, ...
    assert [[pieces.index(p) for p in r.hypotheses[0]] for r in theirs] == [
        _generated_ids([BOS_ID, *row]) for row in np.asarray(ours).tolist()
    ]

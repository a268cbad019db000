"""The translate CLI and evaluation with beam search, on a tiny trained run."""

import collections
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, compiled_programs, copy_of_trained_tiny_run, run_entry_point

from common.special_ids import EOS_ID
from input_pipeline.batching import RaggedIds
from models import continuous_batching
from models.beam_search import BeamSearch
from training import inference
from training.reporting import attention_maps, attention_page
from training.tasks import translation_decoding

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained_workdir(trained_tiny_run, tmp_path_factory):
    """The shared tiny run (trained without TensorFlow, with its config.json), copied: these tests write into it."""
    return copy_of_trained_tiny_run(trained_tiny_run, tmp_path_factory.mktemp("translate"))


def test_translate_keeps_one_line_per_input_line(trained_workdir):
    long_line = " ".join(["Click the OK button to close the dialog."] * 20)  # Far over 32 subwords.
    # Without --attention_maps a tab is part of the sentence, so line 6 is as long as line 3.
    lines = ["Click OK.", "", long_line, "   ", "Select a cell.", f"Select a cell.\t{long_line}"]
    result = run_entry_point(
        "translate.py", f"--workdir={trained_workdir}", "--beam_size=2", stdin="\n".join(lines) + "\n"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = result.stdout.split("\n")
    assert outputs[-1] == "" and len(outputs) == len(lines) + 1  # Every line ends with a newline.
    assert outputs[1] == "" and outputs[3] == ""  # Empty in, empty out.
    assert "Line 3 is longer than 32 subwords" in result.stderr
    assert "Line 6 is longer than 32 subwords" in result.stderr
    assert "beam 2, alpha 0.6" in result.stderr


def test_translate_from_a_file_equals_stdin_and_greedy_equals_a_beam_search_of_width_one(trained_workdir, tmp_path):
    lines = ["Click OK.", "Select a cell.", "Close the dialog without saving the document."]
    source = tmp_path / "in.en"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    out = tmp_path / "out.de"
    from_file = run_entry_point("translate.py", f"--workdir={trained_workdir}", f"--input={source}", f"--output={out}")
    assert from_file.returncode == 0, from_file.stderr[-3000:]
    from_stdin = run_entry_point("translate.py", f"--workdir={trained_workdir}", stdin=source.read_text("utf-8"))
    assert out.read_text(encoding="utf-8") == from_stdin.stdout
    assert len(from_stdin.stdout.splitlines()) == len(lines)
    # translate.py's --beam_size=1 is greedy search: run a real beam search of width 1 (at alpha 0 it keeps the
    # most likely extension of its one hypothesis, and stops once a finished one beats it).
    config = inference.load_config(trained_workdir)
    trained = inference.load_trained_model(config, trained_workdir)
    translator = translation_decoding.translator(config, trained.model, trained.tokenizer, trained.mesh)
    beam = BeamSearch(1, 0.0, translation_decoding.SPECIAL_IDS)
    translator = dataclasses.replace(translator, decoder=continuous_batching.row_decoder(trained.model, beam))
    beam_one = inference.translate_lines(translator, trained.params, lines, config.dataset.max_length)
    assert beam_one == from_stdin.stdout.splitlines()


def _compiled(stderr: str) -> collections.Counter:
    """The programs a process compiled, by module name ('jit_advance'), from what JAX logs with JAX_LOG_COMPILES=1:
    'Finished XLA compilation of jit(advance)'."""
    return collections.Counter(
        re.sub(r"\W+", "_", name).strip("_") for name in re.findall(r"Finished XLA compilation of (\S+) in", stderr)
    )


def test_translate_keeps_its_compiled_decoding_in_its_cache_folder_not_one_the_run_names(trained_workdir, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(trained_workdir, workdir)
    config_path = os.path.join(workdir, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    # A run from elsewhere naming a folder of its own (which could hold programs it planted) is not obeyed.
    config["compilation_cache_dir"] = os.path.join(workdir, "planted")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    cache = tmp_path / "cache"
    # A source over the first bucket (16 subwords), then enough short ones to refill the rows: two stages.
    lines = " ".join(["Click the OK button to close the dialog."] * 2) + "\n" + "Click OK.\nSelect a cell.\n" * 60
    runs = []
    for _ in range(2):
        result = run_entry_point(
            "translate.py",
            f"--workdir={workdir}",
            f"--compilation_cache_dir={cache}",
            stdin=lines,
            env={"JAX_LOG_COMPILES": "1"},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append((result.stdout, _compiled(result.stderr)))
    (first_output, first_compiled), (second_output, second_compiled) = runs
    # The first run compiles its decoding, a program a stage of source length and one to narrow to the second,
    # and keeps each in the program store (training/runtime/program_store.py); the second reads them back.
    decoding = collections.Counter({"jit_advance": 2, "jit_narrow": 1})
    assert collections.Counter({name: first_compiled[name] for name in decoding}) == decoding, first_compiled
    kept = [entry for entry in os.listdir(cache / "programs") if entry.startswith("executable_")]
    assert len(kept) == sum(decoding.values()), kept
    assert not any(second_compiled[name] for name in decoding), second_compiled
    assert second_output == first_output
    assert not os.path.exists(os.path.join(workdir, "planted"))


def test_translate_reports_bad_requests_in_one_line(trained_workdir, tmp_path):
    cases = [
        (["--beam_size=2", "--temperature=0.7"], "config.eval.temperature"),
        (["--checkpoint=best:3"], "Unknown checkpoint 'best:3'"),
        ([f"--input={tmp_path / 'missing.txt'}"], "Cannot read --input="),
    ]
    for flags, message in cases:
        result = run_entry_point("translate.py", f"--workdir={trained_workdir}", *flags, stdin="Click OK.\n")
        assert result.returncode == 2, (flags, result.stderr[-2000:])
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error:") and message in last, (flags, last)
        assert "Traceback" not in result.stderr
    empty = tmp_path / "empty_run"
    empty.mkdir()
    result = run_entry_point("translate.py", f"--workdir={empty}", stdin="Click OK.\n")
    assert result.returncode == 2 and "config.json does not exist" in result.stderr
    (empty / "config.json").write_text('{"model": {', encoding="utf-8")  # Cut short.
    result = run_entry_point("translate.py", f"--workdir={empty}", stdin="Click OK.\n")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "config.json is unreadable" in last and "--config=" in last, last
    assert "Traceback" not in result.stderr


def test_evaluation_with_beam_search_writes_bleu_and_chrf_line_for_line(trained_workdir, small_corpus, tmp_path):
    corpus = shutil.copytree(small_corpus, tmp_path / "corpus")
    sources, references = ((corpus / f"valid.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("en", "de"))
    sources[2], references[4] = "", "  "  # Kept: the outputs line up with the files.
    for lang, lines in (("en", sources), ("de", references)):
        (corpus / f"valid.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    result = run_entry_point(
        "train.py",
        "--config=configs/tiny.py",
        f"--workdir={trained_workdir}",
        f"--config.dataset.path={corpus}",
        "--mode=eval",
        "--config.eval.beam_size=3",
        "--config.eval.length_penalty=1.0",
        "--config.eval.split=valid",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = os.path.join(trained_workdir, "eval", "valid")
    with open(os.path.join(out, "scores.json")) as f:
        scores = json.load(f)
    hypotheses, written_references = (
        open(os.path.join(out, name), encoding="utf-8").read().split("\n")[:-1]
        for name in ("hypotheses.txt", "references.txt")
    )
    assert scores["num_sentences"] == len(hypotheses) == len(sources) == 40
    assert written_references == [line.strip() for line in references]
    assert hypotheses[2] == ""  # An empty source translates as an empty line.
    assert scores["decoding"] == "beam 3, alpha 1"
    assert 0 <= scores["chrf"] <= 100 and scores["chrf_signature"].startswith("nrefs:1|case:mixed|eff:yes|nc:6")
    assert scores["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")


def test_translate_draws_attention_maps_for_given_or_translated_targets(trained_workdir, tmp_path):
    maps = tmp_path / "maps"
    lines = "Click OK.\tKlicken Sie auf OK.\n\nSelect a cell.\n"
    result = run_entry_point("translate.py", f"--workdir={trained_workdir}", f"--attention_maps={maps}", stdin=lines)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("\n") == 3
    assert sorted(os.listdir(maps)) == ["index.html", "line_1", "line_3"]  # Nothing for the empty line.
    expected = ["decoder_layer0_cross_attention.png", "decoder_layer0_self_attention.png"]
    expected.append("encoder_layer0_self_attention.png")
    for line in ("line_1", "line_3"):
        assert sorted(os.listdir(maps / line)) == expected
        assert (maps / line / expected[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # And both lines on one page, the given target and the translation.
    page = attention_page.read_attention_page(str(maps / "index.html"))
    assert [(s["name"], s["source"], s["target_origin"]) for s in page] == [
        ("line 1", "Click OK.", "given"),
        ("line 3", "Select a cell.", "translation"),
    ]
    assert page[0]["target"] == "Klicken Sie auf OK." and page[1]["target"] == result.stdout.split("\n")[2]
    assert sorted(attention_maps.figure_file_name(name) for name in page[0]["weights"]) == expected


def test_training_evaluation_writes_the_attention_page_of_the_first_test_sentence(trained_workdir, small_corpus):
    (sentence,) = attention_page.read_attention_page(os.path.join(trained_workdir, "eval", "test", "attention.html"))
    with open(os.path.join(trained_workdir, "eval", "test", "hypotheses.txt"), encoding="utf-8") as f:
        first_translation = f.readline().rstrip("\n")
    with open(os.path.join(small_corpus, "test.en"), encoding="utf-8") as f:
        first_source = f.readline().strip()
    assert (sentence["name"], sentence["source"], sentence["target"]) == (
        "test sentence 1",
        first_source,
        first_translation,
    )
    assert sentence["target_origin"] == "translation"
    assert list(sentence["weights"]) == [
        "encoder/layer_0/self_attention",
        "decoder/layer_0/self_attention",
        "decoder/layer_0/cross_attention",
    ]


def test_output_is_utf8_whatever_the_locale():
    """As the input is read: a translation into German must not depend on the terminal's encoding."""
    write = "from training.text_io import write_output_lines; print('first'); write_output_lines(['Grüße'], None)"
    env = dict(os.environ, PYTHONIOENCODING="ascii")  # As stdout's encoding under a non-UTF-8 locale.
    result = subprocess.run([sys.executable, "-c", write], cwd=REPO_ROOT, env=env, capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == "first\nGrüße\n".encode()


def test_output_to_a_reader_that_stops_early_ends_quietly_with_141():
    """`translate.py ... | head -1`: the tools' stdout writer, with the reader gone after one line."""
    write = "from training.text_io import write_output_lines; write_output_lines(['line'] * 200_000, None)"
    # Buffered stdout, as Python has it by default (unbuffered, a write the reader cut short only ends early).
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    process = subprocess.Popen(
        [sys.executable, "-c", write], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout.readline() == b"line\n"
    process.stdout.close()
    assert process.wait(timeout=120) == 141
    assert process.stderr.read() == b""  # No traceback.


def test_decode_speed_times_every_engine_on_every_line_and_profiles_the_search(trained_workdir, small_corpus, tmp_path):
    """benchmarks/decode_speed.py at a tiny size: both engines translate the split, and the profile sees the loop."""
    pytest.importorskip("ctranslate2")
    output = str(tmp_path / "decode_speed")
    command = [
        "-m",
        "benchmarks.decode_speed",
        f"--workdir={trained_workdir}",
        f"--sources={small_corpus}/test.en",
        f"--references={small_corpus}/test.de",
        "--dtypes=float32",
        "--rounds=1",
        "--nowhole_processes",
        "--beam_sizes=1,2",
        f"--output={output}",
    ]
    result = run_entry_point(*command, "--profile_calls=1")
    assert result.returncode == 0, result.stderr[-3000:]
    with open(output + ".json", encoding="utf-8") as f:
        figures = json.load(f)["figures"]
    engines = {(row["engine"], row["beam_size"]) for row in figures["rows"]}
    expected = {"this project, float32", "CTranslate2, float32", "CTranslate2, int8"}
    assert engines == {(engine, beam) for engine in expected for beam in (1, 2)}
    assert figures["lines"] == 40 and all(row["output_subwords"] >= 40 for row in figures["rows"])  # </s> at least.
    # Ours: the first stage's rows hold the 40 lines at once, so they never narrow: one program, its compiling
    # timed; none is counted for CTranslate2 (more stages: test_translate_keeps_its_compiled_decoding_...).
    for row in figures["rows"]:
        ours = row["engine"].startswith("this project")
        assert row["programs_compiled"] == (1 if ours else None), row
        assert (
            (row["compiling_seconds"] > 0 and row["tracing_seconds"] > 0) if ours else row["compiling_seconds"] is None
        )
    for profile in figures["profiles"].values():
        shares = [bucket["share"] for bucket in profile["buckets"].values()]
        assert abs(sum(shares) - 1) < 1e-6 and profile["buckets"]["matmuls: vocabulary projection"]["share"] > 0

    # Without the export extra's engine (an accelerator's image): this project's rows alone; whole processes too.
    alone = [argument for argument in command[:-2] if argument != "--nowhole_processes"]
    result = run_entry_point(*alone, "--beam_sizes=1", "--noctranslate2", f"--output={output}_alone")
    assert result.returncode == 0, result.stderr[-3000:]
    with open(output + "_alone.json", encoding="utf-8") as f:
        record = json.load(f)
    assert [row["engine"] for row in record["figures"]["rows"]] == ["this project, float32"]
    processes = {process["command"]: process for process in record["figures"]["whole_processes"]}
    assert set(processes) == {
        "translate.py, float32",
        "translate.py, float32, cached",
        "translate.py, float32, one line",
        "translate.py, float32, one line, cached",
        "python: the bare imports",
    }
    cold, cached = processes["translate.py, float32"]["phases"], processes["translate.py, float32, cached"]["phases"]
    assert set(cold) == {"imports", "restore", "tracing", "compiling", "decoding"} and cold["compiling"] > 0
    assert cached["tracing"] == cached["compiling"] == 0  # The program store: nothing traced or compiled again.
    assert list(record["figures"]["startup"]) == ["float32: one line, cached, less the bare imports (s)"]
    assert record["ctranslate2_devices"] == [] and "vs CTranslate2" not in (
        tmp_path / "decode_speed_alone.md"
    ).read_text(encoding="utf-8")


@pytest.mark.parametrize("beam_size", [1, 4])
def test_translating_sources_of_every_bucket_compiles_a_program_a_stage_and_one_a_narrowing(trained_workdir, beam_size):
    """Every program that translation compiles, or reads from the compilation cache, is counted: the config's two
    buckets make two stages, whatever the number of sentences, their lengths and batches."""
    config = inference.load_config(trained_workdir)
    config.eval.beam_size = beam_size
    trained = inference.load_trained_model(config, trained_workdir)
    translator = translation_decoding.translator(config, trained.model, trained.tokenizer, trained.mesh)
    longest = config.dataset.bucket_boundaries[-1]
    sentences = 3 * max(translator.rows.values())
    sources = [[5 + i % 7] * (1 + i % longest) + [EOS_ID] for i in range(sentences)]  # Some cut.
    with compiled_programs() as programs:
        outputs = translation_decoding.translate_ids(translator, trained.params, RaggedIds.from_lists(sources))
    assert len(outputs) == len(sources) and all(outputs)
    assert len(programs) == 3, programs  # advance at each stage, narrow once.


def test_beam_search_batches_hold_as_many_hypotheses_as_greedy_batches_hold_sentences(trained_workdir):
    """eval.per_device_batch_size counts hypotheses: beam 4 decodes a quarter as many sentences at once."""
    config = inference.load_config(trained_workdir)
    trained = inference.load_trained_model(config, trained_workdir)

    def batch_sizes(beam_size):
        beam_config = config.copy_and_resolve_references()
        beam_config.eval.beam_size = beam_size
        return translation_decoding.translator(beam_config, trained.model, trained.tokenizer, trained.mesh).rows

    greedy, beam = batch_sizes(1), batch_sizes(4)
    assert greedy.keys() == beam.keys()
    for length in greedy:
        assert beam[length] == max(1, config.eval.per_device_batch_size // 4 * config.dataset.max_length // length)
        assert beam[length] * 4 <= greedy[length]

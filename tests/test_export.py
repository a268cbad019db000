"""export.py's promises that need no trained model: which configs export, the output folder, the extra."""

import importlib.util
import os

import numpy as np
import pytest
from conftest import run_entry_point

from common.errors import UserInputError
from common.special_ids import EOS_ID
from configs.sweeps import table3
from exporting import dependencies, folder, support
from exporting.network import sin_then_cos_order
from input_pipeline.tokenizer import train_tokenizer
from models.embeddings import sinusoidal_positions

# What each Table 3 variant's model cannot be exported for: the config field the error names.
_NOT_EXPORTABLE = {
    ("key_16", "ctranslate2"): "config.model.key_dim",  # d_k != d_v: one head size in both engines.
    ("key_16", "huggingface"): "config.model.key_dim",
    ("key_32", "ctranslate2"): "config.model.key_dim",
    ("key_32", "huggingface"): "config.model.key_dim",
    ("relative", "huggingface"): "config.model.positional_encoding",  # transformers: no Shaw et al.
    ("relative_values", "huggingface"): "config.model.positional_encoding",
    ("rotary", "huggingface"): "config.model.positional_encoding",
}


@pytest.mark.parametrize("export_format", support.FORMATS)
@pytest.mark.parametrize("variant", [variant.name for variant in table3.VARIANTS])
def test_every_table3_translation_model_exports_or_names_the_field(variant, export_format):
    config = table3.get_config(variant)
    field = _NOT_EXPORTABLE.get((variant, export_format))
    if field is None:
        support.check_exportable(config, export_format)
        return
    with pytest.raises(UserInputError) as error:
        support.check_exportable(config, export_format)
    message = str(error.value)
    assert message.startswith(f"Cannot export to {export_format}: {field} is ") and "\n" not in message


@pytest.mark.parametrize("export_format", support.FORMATS)
@pytest.mark.parametrize("variant", [variant.name for variant in table3.VARIANTS])
def test_every_table3_variant_trained_as_a_classifier_names_the_task(variant, export_format):
    config = table3.get_config(variant)
    config.task = "classification"
    with pytest.raises(UserInputError, match=r"^Cannot export to \w+: config.task is 'classification': .*encoder"):
        support.check_exportable(config, export_format)


def test_huggingface_maps_post_ln_onto_marian_and_pre_ln_onto_blenderbot():
    assert support.huggingface_architecture(table3.get_config("post_ln")) == "marian"
    assert support.huggingface_architecture(table3.get_config("base")) == "blenderbot"
    assert support.huggingface_architecture(table3.get_config("learned_positions")) == "blenderbot"


def test_post_ln_learned_positions_and_untied_embeddings_name_their_field_for_huggingface_only():
    config = table3.get_config("post_ln")
    config.model.positional_encoding = "learned"
    with pytest.raises(UserInputError, match="config.model.positional_encoding is 'learned' with norm_placement"):
        support.check_exportable(config, "huggingface")
    support.check_exportable(config, "ctranslate2")  # A positions table, whatever its values.
    config = table3.get_config("base")
    config.model.tie_embeddings = False
    with pytest.raises(UserInputError, match="config.model.tie_embeddings is False"):
        support.check_exportable(config, "huggingface")
    support.check_exportable(config, "ctranslate2")


def test_reordering_interleaved_sinusoids_gives_marians_table():
    transformers = pytest.importorskip("transformers")
    length, d_model = 64, 32
    marian = transformers.models.marian.modeling_marian.MarianSinusoidalPositionalEmbedding(length, d_model)
    expected = marian.create_weight().numpy()
    ours = sinusoidal_positions(length, d_model)[:, sin_then_cos_order(d_model)]
    np.testing.assert_allclose(ours, expected, rtol=0, atol=2**-23)  # Both round float64 sinusoids to float32.


# --------------------------------------------------------------------------- #
# The output folder.
# --------------------------------------------------------------------------- #


def test_a_failed_export_leaves_no_folder(tmp_path):
    destination = tmp_path / "model"
    with pytest.raises(RuntimeError), folder.written_whole(str(destination), overwrite=False) as staging:
        (tmp_path / "model_part").mkdir()  # Not the staging folder: must survive.
        with open(os.path.join(staging, "model.bin"), "w") as f:
            f.write("half")
        raise RuntimeError("disk full")
    assert sorted(os.listdir(tmp_path)) == ["model_part"]


def test_an_export_appears_whole_and_readable(tmp_path):
    destination = tmp_path / "model"
    with folder.written_whole(str(destination), overwrite=False) as staging:
        assert not destination.exists()
        with open(os.path.join(staging, "model.bin"), "w") as f:
            f.write("weights")
    assert os.listdir(tmp_path) == ["model"]
    assert (destination / "model.bin").read_text() == "weights"
    assert oct(destination.stat().st_mode & 0o777) == "0o755"
    assert oct((destination / "model.bin").stat().st_mode & 0o777) == "0o644"


def test_a_non_empty_folder_is_replaced_only_with_overwrite(tmp_path):
    destination = tmp_path / "model"
    destination.mkdir()
    (destination / "old.bin").write_text("old")
    with pytest.raises(UserInputError, match="--overwrite"):
        with folder.written_whole(str(destination), overwrite=False):
            pass
    with folder.written_whole(str(destination), overwrite=True) as staging:
        with open(os.path.join(staging, "new.bin"), "w") as f:
            f.write("new")
    assert os.listdir(destination) == ["new.bin"]
    assert os.listdir(tmp_path) == ["model"]  # No staging or replaced folder left behind.
    empty = tmp_path / "empty"
    empty.mkdir()
    with folder.written_whole(str(empty), overwrite=False):
        pass  # An empty folder is no export to lose.


# --------------------------------------------------------------------------- #
# The command line.
# --------------------------------------------------------------------------- #


def test_a_missing_export_extra_is_one_line_naming_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "ctranslate2" else find_spec(name))
    with pytest.raises(
        UserInputError, match=r'--format=ctranslate2 needs ctranslate2, .*pip install -e "\.\[export\]"'
    ):
        dependencies.check_installed("ctranslate2")
    dependencies.check_installed("huggingface")


def test_export_names_the_config_field_before_reading_a_checkpoint(tmp_path):
    workdir = tmp_path / "key_16_run"  # A config, no checkpoint: neither format holds its key size.
    workdir.mkdir()
    config = table3.get_config("key_16")
    (workdir / "config.json").write_text(config.to_json(), encoding="utf-8")
    output = tmp_path / "exported"
    for export_format in support.FORMATS:
        result = run_entry_point("export.py", f"--workdir={workdir}", f"--format={export_format}", f"--output={output}")
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.strip().splitlines()[-1] == (
            f"error: Cannot export to {export_format}: config.model.key_dim is 16 (d_v is 64): {export_format} "
            "attention has one head size for queries, keys and values."
        )
        assert "Traceback" not in result.stderr and not output.exists()


def test_huggingface_tokenizer_decodes_any_ids_as_sentencepiece_does(small_corpus, tmp_path):
    """Outputs are ids the model chose, not only what SentencePiece would encode: starting with lone
    word-boundary pieces, say, whose spaces SentencePiece drops (its ids are what translate.py prints)."""
    pytest.importorskip("transformers")
    from exporting.hf_tokenizer import WORD_BOUNDARY, huggingface_tokenizer  # After importorskip.

    with open(os.path.join(small_corpus, "train.de"), encoding="utf-8") as f:
        sp = train_tokenizer(f.read().splitlines(), str(tmp_path / "sp.model"), vocab_size=500)
    tokenizer = huggingface_tokenizer(sp, max_length=64)
    boundary = sp.piece_to_id(WORD_BOUNDARY)
    assert sp.id_to_piece(boundary) == WORD_BOUNDARY  # A piece of its own, which a model may emit.
    rng = np.random.default_rng(0)
    for _ in range(500):
        ids = [int(i) for i in rng.integers(EOS_ID + 1, sp.get_piece_size(), rng.integers(1, 8))]
        ids = [boundary] * int(rng.integers(0, 3)) + ids
        assert tokenizer.decode(ids + [EOS_ID], skip_special_tokens=True) == sp.decode(ids), ids

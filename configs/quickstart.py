r"""A small Transformer on the bundled LibreOffice-help English→German corpus, for a 2-core CPU.

  python train.py --config=configs/quickstart.py --workdir=runs/quickstart

Trains 2 + 2 layers for 1,300 steps of 16 packed rows, then evaluates the test split with
greedy decoding. Measured on a 2-core AMD EPYC with AVX2 only (2026-11-24), where 'auto' trains
in float32, at 2.0-3.2 steps/s: the whole command took 9 min 6 s from an empty workdir (8 min
17 s in an earlier run that day, at 2.6-3.4 steps/s) and reached 23.34 detokenized sacreBLEU on
the 2,212-pair test split (21.09 on 256 validation sentences). The earlier recipe (3 + 3 layers,
700 steps of 64 rows, dropout 0.1, peak 1e-3 after 300 warm-up steps) took 28 min 47 s there for
22.51. On a 2-core AMD EPYC with AVX-512 and AVX512-BF16, where 'auto' trains in bfloat16, the
command took 5 min 50 s for 22.19 test BLEU (chrF 50.6; 2026-11-26, commit 94797b1, in a slow
hour; 4 min 53 s at e10f9d5 an hour before, 4 min 23 s at 4fe2e45, the same model and batches).
Training is
deterministic: a rerun on the same machine gives the same numbers.
"""

import os

from configs import default

BUNDLED_CORPUS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "libreoffice_help_en_de"
)


def get_config():
    """Returns the quick-start config."""
    config = default.get_config()
    config.num_train_steps = 1300
    config.log_every_steps = 50
    config.eval_every_steps = 1300  # One BLEU check on validation, at the end.
    config.checkpoint_every_steps = 650
    config.keep_checkpoints = 2
    config.per_device_batch_size = 16  # 16 rows x 64 = 1,024 target positions a batch, ~99% real when packed.

    config.dataset.name = "parallel_text"
    config.dataset.path = BUNDLED_CORPUS
    config.dataset.valid_split = "valid"
    config.dataset.max_length = 64
    config.dataset.bucket_boundaries = (8, 16, 24, 32, 48, 64)

    config.tokenizer.vocab_size = 8_000
    config.tokenizer.max_training_sentences = 200_000

    config.model.d_model = 256
    config.model.num_heads = 4
    config.model.d_ff = 1024
    config.model.num_layers = 2
    # No dropout, as in the probe runs that chose this recipe (README): ~1.3M target positions are ~2 epochs.
    config.model.dropout_rate = 0.0
    config.model.max_len = 128
    config.model.norm_placement = "pre"
    config.model.dtype = "auto"  # bfloat16, or float32 on a CPU without bf16 matmul instructions.

    config.optimizer.schedule = "rsqrt"
    config.optimizer.peak_learning_rate = 2e-3
    config.optimizer.warmup_steps = 150

    config.eval.num_bleu_sentences = 256
    config.eval.max_decode_length = 128
    config.eval.per_device_batch_size = 64
    return config

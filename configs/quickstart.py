r"""A small Transformer on the bundled LibreOffice-help English→German corpus, for a 2-core CPU.

  python train.py --config=configs/quickstart.py --workdir=runs/quickstart

Trains a pre-LN model of 2 + 2 layers (d_model 256, 4 heads, d_ff 1024, an 8k shared
vocabulary) for 1,300 steps of 16 packed rows of 64 subwords, then evaluates the test split with
greedy decoding. The recipe is sized to finish in minutes on two CPU cores: a smaller model on
smaller batches trains further in a fixed time than the paper's shape scaled down, and without
dropout, since ~2 epochs are far from overfitting. 'auto' trains with bf16 matmuls where the
CPU has bf16 matmul instructions and in float32 elsewhere.

Expect a model that translates the help's sentences recognisably (test BLEU in the low 20s) from
an empty workdir in minutes; measured: see the README's results table. Training is
deterministic: a rerun on the same machine gives the same numbers; another CPU may round float32
differently and end a little apart.
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
    # No dropout, as in the probe runs that chose this recipe: ~1.3M target positions are ~2 epochs.
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

r"""A tiny model on the bundled corpus, for tests (seconds, not minutes): few steps, short rows, a 300-piece vocabulary.

  python train.py --config=configs/tiny.py --workdir=runs/tiny

Expected: runs end to end; BLEU near 0 (it trains for a handful of steps); no attention maps (add
--config.eval.attention_maps=True for them).
"""

from configs import quickstart


def get_config():
    """Returns the test config."""
    config = shrink(quickstart.get_config())
    config.model.dropout_rate = 0.1  # The tests cover dropout's random streams.
    config.optimizer.peak_learning_rate = 1e-3
    config.eval.num_bleu_sentences = 16
    config.eval.max_decode_length = 16
    # Drawing them is a large share of a tiny run's time; the tests that read them turn them on.
    config.eval.attention_maps = False
    return config


def shrink(config):
    """`config` with the tiny model, vocabulary, batches and schedule of the tests (for any task)."""
    config.num_train_steps = 6
    config.log_every_steps = 2
    config.eval_every_steps = 3
    config.checkpoint_every_steps = 3
    config.per_device_batch_size = 8
    config.dataset.max_length = 32
    config.dataset.bucket_boundaries = (16, 32)
    config.tokenizer.vocab_size = 300
    config.model.d_model = 32
    config.model.num_heads = 2
    config.model.d_ff = 64
    config.model.num_layers = 1
    config.model.dtype = "float32"
    config.optimizer.warmup_steps = 2
    config.eval.per_device_batch_size = 16
    # A nominal matmul peak for the log's MFU: measuring the CPU's (training/flops.py, a 2048^2
    # matmul, 2-3 s at each start) would take longer than most test runs train.
    config.peak_flops_per_device = 1e11
    return config

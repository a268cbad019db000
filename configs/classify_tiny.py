r"""A tiny classifier on the bundled labelled help sentences, for tests (seconds, not minutes).

  python train.py --config=configs/classify_tiny.py --workdir=/tmp/classify_tiny

Expected: runs end to end; accuracy near the majority class (it trains for a handful of steps).
"""

from configs import classify


def get_config():
    """Returns the classification test config."""
    config = classify.get_config()
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
    return config

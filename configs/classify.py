r"""Classification with the encoder: which application's help a LibreOffice help sentence comes from.

  python train.py --config=configs/classify.py --workdir=runs/classify
  echo "Enter the formula in the cell and press Enter." | python classify.py --workdir=runs/classify

The bundled data/libreoffice_help_topics (English help sentences, 7 labels: writer,
calc, impress_draw, basic, math, base, chart; 27,430 train, 1,485 valid, 1,449 test)
through the same loop, checkpoints and CLI as translation: an 8k SentencePiece
vocabulary, a pre-LN encoder (d_model 256, 4 heads, d_ff 1024, 3 layers, 'auto'
precision), the mean of its outputs over the real tokens, dropout and a linear head,
trained with Adam (peak 1e-3, label smoothing 0.1, dropout 0.3) for 2,100 steps of
~2k padded tokens (~8.7 epochs); the checkpoint with the best validation accuracy is kept
apart (--checkpoint=best). At the end the test split is evaluated into
<workdir>/eval/test/{scores.json,predictions.tsv,confusion_matrix.png}.

Expected: test accuracy in the low 0.8s, a little above a bag-of-words linear classifier on
the same split (`python benchmarks/bag_of_words.py`), far above the majority class; measured:
see the README's results table and docs/classification.md. Training is deterministic: a rerun
gives the same numbers.
"""

import os

from configs import quickstart

BUNDLED_TOPICS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "libreoffice_help_topics"
)


def get_config():
    """Returns the classification config."""
    config = quickstart.get_config()
    config.task = "classification"
    config.num_train_steps = 2100
    config.log_every_steps = 100
    config.eval_every_steps = 300
    config.checkpoint_every_steps = 300
    config.keep_checkpoints = 2
    config.per_device_batch_size = 32  # 32 x 64 = 2,048 padded tokens a batch.

    config.dataset.name = "labelled_text"
    config.dataset.path = BUNDLED_TOPICS
    config.dataset.valid_split = "valid"
    config.dataset.max_length = 64
    config.dataset.bucket_boundaries = (8, 16, 24, 32, 48, 64)

    config.tokenizer.vocab_size = 8_000

    config.model.num_layers = 3
    config.model.dropout_rate = 0.3  # Sentences are few (27k) and short: the model overfits them fast.
    config.model.attention_dropout_rate = 0.1
    config.model.pooling = "mean"

    config.optimizer.peak_learning_rate = 1e-3
    config.optimizer.warmup_steps = 200
    config.optimizer.label_smoothing = 0.1

    config.eval.per_device_batch_size = 64
    return config

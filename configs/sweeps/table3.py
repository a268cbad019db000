r"""The paper's Table 3 (variations on the Transformer) on the bundled corpus; pre-LN, relative and rotary positions.

  python sweep.py --sweep=configs/sweeps/table3.py --root=runs/table3
  python train.py --config=configs/sweeps/table3.py:heads_1 --config.seed=0 --workdir=runs/table3/heads_1/seed_0

The base is the quick-start's model as its first recipe trained it (configs/quickstart.py,
d_model 256, 4 heads so d_k = d_v = 64 as in the paper, d_ff 1024, sinusoidal positions,
pre-LN; 3 + 3 layers, dropout 0.1 and label smoothing 0.1, the base the rows are scaled from)
trained for 600 steps of 32 packed rows of 64 subwords (~2k target positions a batch),
validated every 100 steps (loss and perplexity on the whole validation split; no BLEU check)
and evaluated on the test split with greedy decoding. Pre-LN rather than the paper's
post-LN: at this length post-LN trains slower (probe runs at 500 steps were several BLEU
behind), so pre-LN leaves more room for the variants' differences to show; row (F) trains the
paper's post-LN. A base run takes minutes on two CPU cores; docs/ablations.md gives the
command that writes the sweep's table as a record.

Each variant changes what the paper's row changes, scaled to this base: the paper's
base has 6 layers, d_model 512 and 8 heads; here 3 layers, d_model 256 and 4 heads,
so e.g. the paper's h=4 (d_k=128) row is h=2 here (d_k=128), and its N=2 row is
N=1. `Variant.paper` names the row and gives its numbers (newstest2013, perplexity per
wordpiece, BLEU, parameters in millions).

The variants are in the order a partial sweep is most informative in: the base,
then one variant of each row, then the rest. A variant that sets a field this checkout's config
lacks stops with one line saying so, and the others run.
"""

import ml_collections

from configs import quickstart
from configs.sweeps import Paper, Variant, config_for


def base_config() -> ml_collections.ConfigDict:
    """The sweep's base: the quick-start's model with 3 + 3 layers and dropout (pre-LN), minutes a run on a CPU."""
    config = quickstart.get_config()
    config.model.norm_placement = "pre"  # Row (F) trains the paper's post-LN.
    # The Table 3 base as its runs were trained (the quick-start now trains 2 + 2 layers without dropout).
    config.model.num_layers = 3
    config.model.dropout_rate = 0.1
    config.num_train_steps = 600
    config.per_device_batch_size = 32  # 32 rows x 64 = 2,048 target positions a batch, ~97% real.
    # float32 on every CPU: the fast path where bf16 matmuls are emulated (AVX2), and the same numbers
    # up to rounding on every CPU kind, so that one sweep's runs can come from several machines.
    config.model.dtype = "float32"
    config.optimizer.peak_learning_rate = 1e-3
    config.optimizer.warmup_steps = 200
    config.log_every_steps = 50
    config.eval_every_steps = 100  # Validation perplexity every 100 steps: the curves of the sweep.
    config.eval.num_bleu_sentences = 0  # Test BLEU is what the table reports.
    # What the table does not report costs nothing: one checkpoint, at the end (a stop signal saves
    # too), no attention maps, no matmul peak measured for an MFU.
    config.checkpoint_every_steps = config.num_train_steps
    config.keep_checkpoints = 1
    config.eval.attention_maps = False
    config.peak_flops_per_device = -1.0
    config.eval.max_decode_length = 96  # Test sources are at most 64 subwords; outputs up to 2x + 8.
    return config


_BASE = Paper("base: N=6, d_model 512, d_ff 2048, h=8, d_k=d_v=64, P_drop 0.1, ε_ls 0.1", 4.92, 25.8, 65)
_NOT_IN_TABLE = Paper("not in Table 3")

VARIANTS = (
    Variant("base", "base", "N=3, d_model 256, d_ff 1024, h=4, d_k=d_v=64, pre-LN, sinusoidal", {}, _BASE),
    # One of each row first.
    Variant(
        "heads_1", "(A) heads", "h=1, d_k=d_v=256", {"model.num_heads": 1}, Paper("(A) h=1, d_k=d_v=512", 5.29, 24.9)
    ),
    Variant("key_16", "(B) key size", "d_k=16, d_v=64", {"model.key_dim": 16}, Paper("(B) d_k=16", 5.16, 25.1, 58)),
    Variant("layers_1", "(C) size", "N=1", {"model.num_layers": 1}, Paper("(C) N=2", 6.11, 23.7, 36)),
    Variant(
        "dropout_0", "(D) regularization", "P_drop=0", {"model.dropout_rate": 0.0}, Paper("(D) P_drop=0.0", 5.77, 24.6)
    ),
    Variant(
        "smoothing_0",
        "(D) regularization",
        "ε_ls=0",
        {"optimizer.label_smoothing": 0.0},
        Paper("(D) ε_ls=0.0", 4.67, 25.3),
    ),
    Variant(
        "learned_positions",
        "(E) positions",
        "learned positional embeddings",
        {"model.positional_encoding": "learned"},
        Paper("(E) positional embedding instead of sinusoids", 4.92, 25.7),
    ),
    Variant(
        "post_ln",
        "(F) normalization",
        "post-LN, as the paper",
        {"model.norm_placement": "post"},
        Paper("the paper's base (post-LN)", 4.92, 25.8, 65),
    ),
    Variant(
        "relative",
        "(G) positions",
        "relative positions (Shaw et al.), clip 16, keys only",
        {"model.positional_encoding": "relative"},
        _NOT_IN_TABLE,
    ),
    Variant(
        "rotary", "(H) positions", "rotary positions (RoPE)", {"model.positional_encoding": "rotary"}, _NOT_IN_TABLE
    ),
    # The rest of each row.
    Variant(
        "heads_8", "(A) heads", "h=8, d_k=d_v=32", {"model.num_heads": 8}, Paper("(A) h=16, d_k=d_v=32", 4.91, 25.8)
    ),
    Variant(
        "heads_16", "(A) heads", "h=16, d_k=d_v=16", {"model.num_heads": 16}, Paper("(A) h=32, d_k=d_v=16", 5.01, 25.4)
    ),
    Variant(
        "heads_2", "(A) heads", "h=2, d_k=d_v=128", {"model.num_heads": 2}, Paper("(A) h=4, d_k=d_v=128", 5.00, 25.5)
    ),
    Variant("key_32", "(B) key size", "d_k=32, d_v=64", {"model.key_dim": 32}, Paper("(B) d_k=32", 5.01, 25.4, 60)),
    Variant("layers_2", "(C) size", "N=2", {"model.num_layers": 2}, Paper("(C) N=4", 5.19, 25.3, 50)),
    Variant("layers_4", "(C) size", "N=4", {"model.num_layers": 4}, Paper("(C) N=8", 4.88, 25.5, 80)),
    Variant(
        "d_model_128",
        "(C) size",
        "d_model 128, d_k=d_v=32",
        {"model.d_model": 128},
        Paper("(C) d_model 256, d_k=d_v=32", 5.75, 24.5, 28),
    ),
    Variant(
        "d_model_512",
        "(C) size",
        "d_model 512, d_k=d_v=128",
        {"model.d_model": 512},
        Paper("(C) d_model 1024, d_k=d_v=128", 4.66, 26.0, 168),
    ),
    Variant("d_ff_512", "(C) size", "d_ff 512", {"model.d_ff": 512}, Paper("(C) d_ff 1024", 5.12, 25.4, 53)),
    Variant("d_ff_2048", "(C) size", "d_ff 2048", {"model.d_ff": 2048}, Paper("(C) d_ff 4096", 4.75, 26.2, 90)),
    Variant(
        "dropout_0.2",
        "(D) regularization",
        "P_drop=0.2",
        {"model.dropout_rate": 0.2},
        Paper("(D) P_drop=0.2", 4.95, 25.5),
    ),
    Variant(
        "smoothing_0.2",
        "(D) regularization",
        "ε_ls=0.2",
        {"optimizer.label_smoothing": 0.2},
        Paper("(D) ε_ls=0.2", 5.47, 25.7),
    ),
    Variant(
        "relative_values",
        "(G) positions",
        "relative positions, clip 16, keys and values",
        {"model.positional_encoding": "relative", "model.relative_values": True},
        _NOT_IN_TABLE,
    ),
)


def get_config(variant: str = "base") -> ml_collections.ConfigDict:
    """The base config with `variant`'s overrides (`--config=configs/sweeps/table3.py:<variant>`)."""
    return config_for(base_config(), VARIANTS, variant)

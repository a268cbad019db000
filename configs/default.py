r"""Transformer-base on WMT14 English→German, as in the paper (Vaswani et al., 2017).

Run on a TPU/GPU host with `wmt14_translate/de-en` prepared for TFDS (see README):

  python train.py --config=configs/default.py --workdir=runs/wmt14_base

Expected: the paper reports 27.3 BLEU (newstest2014, tokenized, checkpoint-averaged,
beam 4) after 100k steps of ~25k source + ~25k target tokens on 8 GPUs. Greedy
decoding and detokenized sacreBLEU without averaging score lower. Not measured
with this codebase yet; the same code runs end to end in `configs/quickstart.py`
and the tests.
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
    """Returns the Transformer-base config."""
    config = ml_collections.ConfigDict()

    # 'translation' (the encoder-decoder) or 'classification' (the encoder, pooled, and a
    # linear head over the labels of a labelled-text dataset; see configs/classify.py).
    config.task = "translation"
    config.seed = 0
    config.num_train_steps = 100_000
    config.log_every_steps = 100
    config.eval_every_steps = 5_000
    config.checkpoint_every_steps = 5_000
    config.keep_checkpoints = 5  # The last K checkpoints are kept.
    # Rows of dataset.max_length per device in a training batch (translation: packed rows
    # of the stream; classification: sequences of the longest bucket, shorter buckets hold
    # proportionally more), so every batch carries about
    # per_device_batch_size * num_devices * dataset.max_length tokens.
    # 12 x 8 devices x 256 ≈ 24.6k target positions a batch, about the paper's 25k.
    config.per_device_batch_size = 12
    # Micro-batches per optimizer step: each holds the batch above, and their
    # gradients are summed (lax.scan) before one update, so a batch this many times
    # larger fits in the memory of one (e.g. the paper's 25k tokens on 1 GPU: 8).
    config.grad_accumulation_steps = 1
    # How the train step is compiled: 'jit' over the mesh below (data, FSDP and
    # tensor parallelism), or 'pmap' (data parallel only: the state replicated on
    # every device, gradients summed with lax.psum; needs mesh.fsdp = mesh.tensor = 1).
    config.step_compilation = "jit"
    # Options of the step's speed, not of what it trains (training/step_options.py): the PRNG
    # of dropout's bits ('threefry2x32', 'rbg' or 'unsafe_rbg': cheaper bits on GPUs and TPUs),
    # and the vocabulary loss computed this many slices of target positions at a time (1: all
    # logits at once).
    config.prng_impl = "threefry2x32"
    config.loss_chunks = 1
    # A step whose loss, gradients or new parameters are not finite (NaN, inf) is
    # never applied. 'stop': end training there (exit status 3), naming the last
    # checkpoint, which holds finite values. 'skip': skip that update and go on,
    # ending training after max_nonfinite_in_a_row such steps in a row.
    config.nonfinite = "stop"
    config.max_nonfinite_in_a_row = 10
    # JAX's persistent compilation cache: compiled steps are stored here and reused by later
    # runs and restarts (training/runtime/compilation_cache.py). '' turns it off.
    config.compilation_cache_dir = "~/.cache/aiayn/jax_compilation"
    # Dense matmul peak of one device in FLOP/s, for the MFU in the training log (training/flops.py).
    # 0: from the table of accelerators (H100, H200, A100, TPU v4/v5e/v5p), or measured on a CPU
    # (a second at start-up); < 0: no MFU, nothing measured.
    config.peak_flops_per_device = 0.0

    # The device mesh: data x fsdp x tensor must equal the number of devices;
    # one axis may be -1, taking the devices the others leave.
    config.mesh = mesh = ml_collections.ConfigDict()
    mesh.data = -1  # Batch split, state replicated.
    mesh.fsdp = 1  # Batch split, parameters and optimizer state sharded (on the 'embed' axis).
    mesh.tensor = 1  # Attention heads, feed-forward units and vocabulary split; batch replicated.
    # Logical axis -> mesh axis (or tuple of axes, or None: replicated). Parameters
    # name their dimensions 'embed' (d_model), 'heads', 'kv' (head_dim), 'mlp' (d_ff),
    # 'vocab', 'norm' (LayerNorm) and 'classes' (a classifier's head); batches are split on 'batch'. The first rule
    # naming an axis wins, and a mesh axis shards at most one dimension of an array.
    mesh.rules = (
        ("batch", ("data", "fsdp")),
        ("vocab", "tensor"),
        ("heads", "tensor"),
        ("mlp", "tensor"),
        ("embed", "fsdp"),
        ("kv", None),
        ("norm", None),
        ("classes", None),
    )

    config.dataset = dataset = ml_collections.ConfigDict()
    # A TFDS name ('wmt14_translate/de-en', 'wmt17_translate/de-en', ...) or
    # 'parallel_text' for aligned text files in `dataset.path`. Classification: a TFDS
    # text-classification name ('imdb_reviews', 'glue/sst2') or 'labelled_text' for
    # {train,valid,test}.tsv[.gz] files of 'label<TAB>text' lines in `dataset.path`.
    dataset.name = "wmt14_translate/de-en"
    # Folder of {train,valid,test}.{source_lang,target_lang}[.gz] files, one
    # sentence per line (dataset.name 'parallel_text'), or of {train,valid,test}.tsv[.gz]
    # files of 'label<TAB>text' lines ('labelled_text').
    dataset.path = ""
    # Where TFDS keeps prepared data; '' means the TFDS default for named
    # datasets and <workdir>/tfds for parallel text.
    dataset.data_dir = ""
    dataset.source_lang = "en"
    dataset.target_lang = "de"
    dataset.train_split = "train"
    dataset.valid_split = "validation"
    # Pairs longer than this (in subwords, with <eos>) are left out of training;
    # longer evaluation sources are truncated with a warning.
    dataset.max_length = 256
    # Length buckets (subwords) of evaluation and decoding batches, and of classification's
    # training batches; the last must be dataset.max_length. One compiled step per bucket.
    dataset.bucket_boundaries = (16, 32, 48, 64, 96, 128, 192, 256)
    # Translation trains from a stream (input_pipeline/streaming.py): rows of dataset.max_length,
    # per_device_batch_size of them per device, so the train step compiles once. With packing,
    # several pairs share a row (segment ids keep them apart); without, one pair per row, padded.
    dataset.packing = True
    # Pairs per row the packer keeps in view and picks from, longest first, each into the row it
    # fills best (input_pipeline/row_packing.py): 8 leaves nearly no padding, and a larger view
    # fills no more. 0: first fit, each pair as it comes, as grain packs (more padding).
    dataset.packing_lookahead = 8
    # 0: one background thread of the training process reads, tokenizes and packs (for the
    # quick-start's rows a small share of one core); N > 0: N worker processes build the
    # batches, where cores are free and one thread cannot keep up. A saved data position is
    # only valid for the same number: changing it restarts the stream (streaming.TrainStream).
    dataset.num_workers = 0

    config.tokenizer = tokenizer = ml_collections.ConfigDict()
    tokenizer.vocab_size = 32_000  # Shared by source and target.
    tokenizer.model_type = "unigram"  # SentencePiece: 'unigram' or 'bpe'.
    tokenizer.max_training_sentences = 2_000_000  # Sampled from both sides.

    config.model = model = ml_collections.ConfigDict()
    model.d_model = 512
    model.num_heads = 8
    model.d_ff = 2048
    model.num_layers = 6  # Both stacks, unless overridden below.
    model.num_encoder_layers = -1  # -1: use num_layers.
    model.num_decoder_layers = -1  # -1: use num_layers.
    model.dropout_rate = 0.1
    model.attention_dropout_rate = 0.0
    # 'sinusoidal' (the paper) or 'learned': added to the embeddings. 'relative' (Shaw et al.,
    # 2018): learned vectors of the clipped distance j - i added to the keys (and values) of
    # every self-attention. 'rotary' (RoPE, Su et al., 2021): self-attention's queries and
    # keys rotated by position-dependent angles. Cross-attention never sees positions.
    model.positional_encoding = "sinusoidal"
    # 'relative': distances beyond +-relative_clip share one vector (Shaw et al. use 16; every
    # clip >= 2 gave about the same BLEU in their ablation). relative_values adds the a^V terms
    # to the values too: keys alone matched keys and values there, so off by default.
    model.relative_clip = 16
    model.relative_values = False
    # Each head's query and key size d_k; 0: d_model // num_heads (the paper). The values keep
    # d_v = d_model // num_heads (Table 3 row B shrinks d_k alone).
    model.key_dim = 0
    # Positions the model can encode: at least dataset.max_length and
    # eval.max_decode_length (the size of the learned table; 'relative' and 'rotary'
    # have no such limit but keep the bound).
    model.max_len = 512
    model.norm_placement = "post"  # 'post' (the paper) or 'pre'.
    model.tie_embeddings = True  # Source/target embeddings and output layer.
    # Compute dtype of the matmuls: 'float32', 'bfloat16', or 'auto' (models/build.py): bfloat16
    # on TPUs, on GPUs from Ampere on and on CPUs with bf16 matmul instructions, else float32.
    model.dtype = "auto"
    # How attention is computed where no attention weight is needed (no attention dropout, no
    # attention maps): 'auto' (cuDNN's fused kernel on GPUs in bfloat16, except at shapes of
    # known cuDNN defects; else 'explicit'),
    # 'explicit' (softmax(QK^T/sqrt(d_k))V as written, models/attention.py), or
    # jax.nn.dot_product_attention's 'xla' or 'cudnn' implementation.
    model.attention_implementation = "auto"
    # Classification: the encoder's outputs are summarised by 'mean' (over the real
    # tokens) or 'cls' (the output at a [CLS] token put before each sentence).
    model.pooling = "mean"

    config.optimizer = optimizer = ml_collections.ConfigDict()
    # The learning rate warms up linearly for warmup_steps, then decays as 1 / sqrt(step).
    # 'paper' (section 5.3): lr(step) = learning_rate_scale * model.d_model^-0.5 *
    # min(step^-0.5, step * warmup_steps^-1.5), so its peak (at warmup_steps) follows the
    # model's width and the warm-up: 512^-0.5 * 4000^-0.5 ≈ 7.0e-4 here.
    # 'rsqrt' (configs/quickstart.py and those built on it): the same shape, its peak peak_learning_rate.
    optimizer.schedule = "paper"
    optimizer.learning_rate_scale = 1.0  # 'paper' only.
    optimizer.peak_learning_rate = config_dict.placeholder(float)  # 'rsqrt' only.
    optimizer.warmup_steps = 4_000
    optimizer.b1 = 0.9
    optimizer.b2 = 0.98
    optimizer.eps = 1e-9
    optimizer.grad_clip_norm = 0.0  # 0 disables clipping.
    optimizer.label_smoothing = 0.1

    config.eval = eval_config = ml_collections.ConfigDict()
    eval_config.split = "test"  # Evaluated after training and by --mode=eval.
    # Source sentences of the validation split translated for the BLEU check
    # during training (0: skip it).
    eval_config.num_bleu_sentences = 512
    # The longest output: each sentence gets min(this, 2 x its source's subwords + 8) (models/decoding.py).
    eval_config.max_decode_length = 256
    # Hypotheses decoded at once per device (sentences of the longest bucket): beam search takes
    # per_device_batch_size / beam_size sentences of beam_size hypotheses each (models/decoding.py).
    eval_config.per_device_batch_size = 32
    # Decoding for evaluation and translate.py. beam_size 1 is greedy; the paper uses
    # beam 4 with length penalty alpha 0.6: score = log P / ((5 + length) / 6) ** alpha.
    eval_config.beam_size = 1
    eval_config.length_penalty = 0.6
    # > 0 samples each token from softmax(logits / temperature) instead of searching
    # (needs beam_size 1); top_k > 0 samples among the k most likely tokens only.
    eval_config.temperature = 0.0
    eval_config.top_k = 0
    # Draw the attention maps of the split's first sentence into TensorBoard after evaluating.
    eval_config.attention_maps = True

    return config

"""Config R: the model both frameworks train in benchmarks/peer_throughput.py, and its step in each.

d_model 256, 4 heads, d_ff 1024, 3 + 3 layers, post-LN, a shared 8k vocabulary (embeddings and
output layer tied, sinusoidal positions), dropout 0.1, label smoothing 0.1, Adam (β 0.9/0.98,
ε 1e-9), a batch of 32 x 64 random ids with no padding. `ProjectStep` is this project's train
step exactly as train.py builds it (benchmarks/step_profile.py profiles it, and
benchmarks/accelerator_check.py checks it); `TorchStep` the same model and update in PyTorch, as
a researcher would write it. What differs, as each framework's standard layers have it:
PyTorch's attention has biases on its q, k, v and output projections, both of its stacks end
with a LayerNorm even post-LN (tests/test_config_r.py counts the parameters), its `dropout` also
drops attention weights and the feed-forward hidden units (this project: attention_dropout_rate
0, no inner dropout), and its LayerNorm ε is 1e-5 (here 1e-6).
"""

import contextlib
import functools
import math
from collections.abc import Callable

import jax
import ml_collections
import numpy as np

from common.special_ids import BOS_ID, EOS_ID
from configs import default
from models.build import make_model
from models.embeddings import sinusoidal_positions
from training import step_options
from training.optimizer import make_optimizer
from training.runtime import sharding
from training.state import initial_state, state_shardings
from training.steps import configured_train_step, translation_loss


def config_r(dtype: str = "float32", dropout_rate: float = 0.1) -> ml_collections.ConfigDict:
    """configs/default.py with config R's overrides, on one device."""
    config = default.get_config()
    config.model.d_model = 256
    config.model.num_heads = 4
    config.model.d_ff = 1024
    config.model.num_layers = 3
    config.model.dropout_rate = dropout_rate
    config.model.norm_placement = "post"
    config.model.dtype = dtype
    config.model.max_len = 64
    config.dataset.max_length = 64
    config.tokenizer.vocab_size = 8_000
    config.per_device_batch_size = 32
    config.optimizer.label_smoothing = 0.1
    # An explicit peak: PyTorch's side trains at it as a constant rate (the step time does not depend on it).
    config.optimizer.update(schedule="rsqrt", peak_learning_rate=7e-4)
    config.mesh.data = 1
    return config


def random_batch(config: ml_collections.ConfigDict, seed: int = 0) -> dict[str, np.ndarray]:
    """'inputs' and 'targets' [per_device_batch_size, max_length] int32: random ordinary ids, no padding."""
    shape = (config.per_device_batch_size, config.dataset.max_length)
    ids = np.random.default_rng(seed).integers(EOS_ID + 1, config.tokenizer.vocab_size, size=(2, *shape))
    return {"inputs": ids[0].astype(np.int32), "targets": ids[1].astype(np.int32)}


def translation_loss_fn(config: ml_collections.ConfigDict, model) -> Callable:
    """The loss train.py trains `model` on, bound as training/tasks/translation.py binds it (without its data stack)."""
    return functools.partial(
        translation_loss,
        model=model,
        label_smoothing=config.optimizer.label_smoothing,
        loss_chunks=step_options.option(config, "loss_chunks"),
    )


class ProjectStep:
    """This project's train step as train.py builds it, on one device, with its state.

    Called, it runs one update on `batch` (placed once), again and again. `wrap_loss` wraps the
    translation loss (the accelerator check's control that cannot see the source).
    """

    def __init__(self, config: ml_collections.ConfigDict, batch: dict[str, np.ndarray] | None = None, wrap_loss=None):
        self.config = config
        self.mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
        self.model = make_model(config, config.tokenizer.vocab_size)
        self.tx, schedule = make_optimizer(config.optimizer, d_model=config.model.d_model)
        self.shardings = state_shardings(config, self.model, self.tx, self.mesh)
        loss_fn = translation_loss_fn(config, self.model)
        self.train_step = configured_train_step(
            config, wrap_loss(loss_fn) if wrap_loss else loss_fn, self.tx, schedule, self.mesh, self.shardings
        )
        self.reset_state()
        self.base_rng = self.state.rng.copy()  # Step keys fold in from it, as in training/loop.py.
        self._batch = None if batch is None else self.train_step.place_batch(batch)
        self._steps_run = 0

    def reset_state(self) -> None:
        """A fresh train state from config.seed on the mesh."""
        self.state = None  # Frees the old one first.
        self.state = self.train_step.enter(initial_state(self.config, self.model, self.tx, self.shardings))

    def compiled_hlo(self) -> str:
        """The optimized HLO module of the step (compiled again: XLA compiles the same module the same way)."""
        key = jax.random.fold_in(self.base_rng, 0)
        return self.train_step.run.lower(self.state, self._batch, key).compile().as_text()

    def __call__(self) -> jax.Array:
        """Runs one update on the batch; returns its loss ([] float32, maybe not computed yet)."""
        key = jax.random.fold_in(self.base_rng, self._steps_run)
        self.state, metrics = self.train_step.run(self.state, self._batch, key)
        self._steps_run += 1
        return metrics["loss"]


class TorchStep:
    """The same model and update in PyTorch (`nn.Transformer`), with one batch it trains on repeatedly.

    On a GPU (`device` 'cuda') Adam is `fused`, as PyTorch recommends there; `compile_backend`
    (e.g. 'inductor') runs the forward pass and loss under `torch.compile`.
    """

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        batch: dict[str, np.ndarray],
        device: str = "cpu",
        compile_backend: str | None = None,
    ):
        import torch  # An optional dependency: the benchmark extra.
        from torch import nn

        self._torch = torch
        self._device = device
        model = config.model
        d_model, vocab_size = model.d_model, config.tokenizer.vocab_size
        layers = make_model(config, vocab_size).config  # The layer counts as models/build.py reads them.
        torch.manual_seed(config.seed)
        embedding = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(embedding.weight, std=d_model**-0.5)  # As this project's TokenEmbedding.
        output = nn.Linear(d_model, vocab_size, bias=False)
        output.weight = embedding.weight  # Tied, as in this project.
        self.modules = nn.ModuleDict(
            {
                "embedding": embedding,
                "dropout": nn.Dropout(model.dropout_rate),
                "transformer": nn.Transformer(
                    d_model=d_model,
                    nhead=model.num_heads,
                    num_encoder_layers=layers.num_encoder_layers,
                    num_decoder_layers=layers.num_decoder_layers,
                    dim_feedforward=model.d_ff,
                    dropout=model.dropout_rate,
                    batch_first=True,
                    norm_first=model.norm_placement == "pre",
                ),
                "output": output,
            }
        ).train()
        self.modules.to(device)
        self._scale = math.sqrt(d_model)
        self._positions = torch.from_numpy(sinusoidal_positions(model.max_len, d_model)).to(device)
        self._cross_entropy = nn.CrossEntropyLoss(label_smoothing=config.optimizer.label_smoothing)
        self._optimizer = torch.optim.Adam(
            self.modules.parameters(),
            lr=config.optimizer.peak_learning_rate,
            betas=(config.optimizer.b1, config.optimizer.b2),
            eps=config.optimizer.eps,
            **({"fused": True} if device != "cpu" else {}),
        )
        self._autocast = (
            (lambda: torch.autocast(torch.device(device).type, dtype=torch.bfloat16))
            if model.dtype == "bfloat16"
            else contextlib.nullcontext
        )
        self._inputs = torch.from_numpy(batch["inputs"]).long().to(device)
        self._targets = torch.from_numpy(batch["targets"]).long().to(device)
        self._forward_loss = torch.compile(self._loss, backend=compile_backend) if compile_backend else self._loss

    def _embed(self, ids):
        """[batch, length] ids -> [batch, length, d_model]: scaled embedding + positions, dropout."""
        x = self.modules["embedding"](ids) * self._scale + self._positions[: ids.shape[1]]
        return self.modules["dropout"](x)

    def _loss(self):
        """The batch's label-smoothed loss ([] float32 tensor), teacher-forced."""
        torch = self._torch
        length = self._targets.shape[1]
        bos = torch.full((self._targets.shape[0], 1), BOS_ID, dtype=self._targets.dtype, device=self._device)
        decoder_inputs = torch.cat([bos, self._targets[:, :-1]], dim=1)
        causal_mask = torch.nn.Transformer.generate_square_subsequent_mask(length, device=self._device)
        with self._autocast():
            hidden = self.modules["transformer"](
                self._embed(self._inputs), self._embed(decoder_inputs), tgt_mask=causal_mask, tgt_is_causal=True
            )
            logits = self.modules["output"](hidden)
            return self._cross_entropy(logits.flatten(0, 1), self._targets.flatten())

    def __call__(self):
        """Runs one update; returns its loss ([] float32 tensor)."""
        self._optimizer.zero_grad()
        loss = self._forward_loss()
        loss.backward()
        self._optimizer.step()
        return loss.detach()

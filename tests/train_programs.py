"""Train states made by one compiled program, for the tests that run the Transformer's train step.

`create_train_state` run eagerly runs Flax's `init` an operation at a time, compiling a small program for each
(a hundred or more, seconds on two cores, all paid by the first test of a file to init a model of those shapes);
jitted, it is one program, a fraction of a second. Tests that start from the same model and optimizer objects
share it in the test process; equal configurations elsewhere read it back from the persistent compilation cache.
"""

import jax

from training.state import create_train_state

# fresh_train_state(model, tx, seed): a fresh state (parameters from `seed`, moments at zero, step 0), compiled
# once per (model, optimizer, seed).
fresh_train_state = jax.jit(create_train_state, static_argnums=(0, 1, 2))

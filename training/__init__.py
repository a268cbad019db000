"""The training core: state, optimizer, losses, the train step, the loop and its subpackages."""

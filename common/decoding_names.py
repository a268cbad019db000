"""How a config's decoding is named in scores, logs and sweep tables (JAX-free, for the sweep runner)."""

import ml_collections


def describe_decoding(eval_config: ml_collections.ConfigDict) -> str:
    """'greedy', 'beam 4, alpha 0.6' or 'sampling, temperature 0.8, top-k 40': for scores and logs."""
    if eval_config.temperature > 0:
        top_k = f", top-k {eval_config.top_k}" if eval_config.top_k else ""
        return f"sampling, temperature {eval_config.temperature:g}{top_k}"
    if eval_config.beam_size > 1:
        return f"beam {eval_config.beam_size}, alpha {eval_config.length_penalty:g}"
    return "greedy"

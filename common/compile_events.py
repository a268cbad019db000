"""The programs XLA compiles inside a block, counted from jax.monitoring's events (tests and benchmarks)."""

import contextlib
from collections.abc import Iterator

import jax

# jax.monitoring's event for each program compiled, or read from the compilation cache, and those of tracing a
# function and lowering it (which a program read from the cache pays too: its key is the lowered module).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACING_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")


@contextlib.contextmanager
def compile_events() -> Iterator[list[tuple[str, float, dict]]]:
    """A list that gets (event, seconds, details such as fun_name) of each compile and tracing event in the block."""
    events = []

    def record(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT or event in TRACING_EVENTS:
            events.append((event, duration, kwargs))

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(record)

"""Several processes (hosts) as one JAX program: start-up and the connection between them.

Every process runs the same program on its own devices; `jax.distributed`
connects them so that arrays and jitted steps span the devices of all of them.
It also watches them: each process sends heartbeats to the coordinator (process
0's host), and when one stops (killed, crashed, host lost) the others are
terminated with an error naming the cause, instead of waiting forever in a
collective.
"""

import errno
import os
import socket
from collections.abc import Mapping

import jax
from absl import logging

from common.errors import UserInputError
from common.processes import barrier

MODES = ("auto", "on", "off")


def coordinator_problem(address: str, process_id: int | None) -> str | None:
    """Why JAX's coordination service could not work at `address` ('host:port'), if it can tell at once.

    JAX does not say: a host that does not resolve leaves the other processes waiting out the
    initialization timeout, and a port already taken on process 0 crashes it (a segmentation
    fault, in jaxlib 0.10). So this checks the host resolves and, on process 0 (which serves
    the coordination on every interface), that the port is free.
    """
    host, colon, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:1234
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"--coordinator_address={address} is not HOST:PORT (process 0's host, and a free port there)."
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"the coordinator's host {host!r} does not resolve ({e.strerror}); give process 0's host name or IP."
    if process_id != 0:
        return None
    # The service binds [::] for IPv4 and IPv6 alike (not IPv6-only), with SO_REUSEADDR: so does the probe.
    for family, any_address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # No IPv6 on this host.
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                probe.bind((any_address, int(port)))
            except OSError as e:
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    return f"process 0 cannot serve the coordination on port {port}: {e.strerror}; choose another port."
                continue  # Not this family's to tell (no IPv6 address here, say).
        break  # Bound: the port is free (for IPv4 too, when the probe was dual-stack IPv6).
    return None


def detect_launcher(environ: Mapping[str, str]) -> str | None:
    """The launcher that started this process as one of several, if its variables say so.

    Only launchers that JAX's own cluster detection also reads from the
    environment: SLURM (`srun`, one task per process) and Open MPI (`mpirun`).
    Cloud TPU pods are found by JAX from the TPU metadata server, which is not
    visible here: use --distributed=on there.

    Args:
        environ: the process's environment variables.

    Returns:
        'slurm', 'open_mpi', or None for a single process.
    """
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(name in environ for name in slurm) and int(environ["SLURM_NTASKS"]) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in environ and int(environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "open_mpi"
    return None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    mode: str = "auto",
    heartbeat_timeout_seconds: int = 30,
    initialization_timeout_seconds: int = 300,
    environ: Mapping[str, str] = os.environ,
) -> bool:
    """Connects this process to the others with `jax.distributed.initialize`, if there are others.

    Must run before anything starts a JAX backend (jax.devices(), any array).

    Args:
        coordinator_address: 'host:port' of process 0, where it serves the
            coordination service; the same on every process.
        num_processes: how many processes take part.
        process_id: this process's index, in [0, num_processes).
        mode: 'auto' connects when any of the three arguments is given or a
            multi-process launcher is detected (`detect_launcher`); 'on' always
            connects, letting JAX find what is not given (Cloud TPU, SLURM,
            Open MPI, Kubernetes); 'off' runs as a single process.
        heartbeat_timeout_seconds: after this long without a heartbeat from a
            process, the others stop with an error.
        initialization_timeout_seconds: how long to wait for all processes to connect.
        environ: the environment variables (for tests).

    Returns:
        Whether this process is now one of several connected ones.

    Raises:
        UserInputError: `mode` is unknown, or the arguments do not describe a
            valid set of processes.
    """
    if mode not in MODES:
        raise UserInputError(f"--distributed={mode!r} is not one of {', '.join(MODES)}.")
    given = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    if mode == "off" or (mode == "auto" and all(v is None for v in given.values()) and not detect_launcher(environ)):
        return False
    flags = " ".join(f"--{name}={value}" for name, value in given.items() if value is not None) or "no flags"
    if coordinator_address is not None and (problem := coordinator_problem(coordinator_address, process_id)):
        raise UserInputError(f"Cannot start several processes with {flags}: {problem}")
    try:
        jax.distributed.initialize(
            **given,
            initialization_timeout=initialization_timeout_seconds,
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        )
    except (ValueError, TypeError) as e:  # How JAX reports missing or inconsistent arguments.
        raise UserInputError(
            f"Cannot start several processes with {flags}: {e} Give --coordinator_address=HOST:PORT, "
            "--num_processes and --process_id on every process, or launch with SLURM, Open MPI or on a Cloud TPU."
        ) from None
    # The first collective sets up the processes' connections (Gloo on CPU), waiting at
    # most 30 s for all of them: here, where they all arrive together, not at a barrier
    # that waits for process 0 to prepare the data.
    barrier("connected")
    logging.info(
        "Process %d of %d: %d of %d devices are local.",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def is_connected() -> bool:
    """Whether this process is one of several connected by `initialize`."""
    return jax.distributed.is_initialized()

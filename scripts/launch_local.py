#!/usr/bin/env python
"""Starts N local JAX processes on 127.0.0.1, as a multi-host cluster would, and waits for them.

Each process gets its own CPU devices and the coordinator's address in its environment:

    JAX_PLATFORMS=cpu
    XLA_FLAGS=--xla_force_host_platform_device_count=K
    SOAPJAX_COORDINATOR=127.0.0.1:PORT     (a free port)
    SOAPJAX_NUM_PROCESSES=N
    SOAPJAX_PROCESS_ID=i

`soapjax.training.initialize_distributed()` reads these and calls `jax.distributed.initialize`
(gloo collectives between the processes). Output is streamed line by line with a ``[pI]``
prefix. The exit status is 0 when every process exits 0; when one fails, the others are stopped
(they would wait for it in a collective) and the first failure's status is returned.

Example::

    python scripts/launch_local.py --processes 2 --devices-per-process 4 -- \\
        scripts/train_example.py --model mlp --steps 3
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import threading
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _xla_flags(devices: int) -> str:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])


def _command(argv: list[str]) -> list[str]:
    """A script path runs with this Python; anything else runs as given."""
    if argv and argv[0].endswith(".py"):
        return [sys.executable, "-u", *argv]
    return argv


def _stream(proc: subprocess.Popen, prefix: str, lock: threading.Lock) -> None:
    for line in iter(proc.stdout.readline, ""):
        with lock:
            sys.stdout.write(f"{prefix} {line}" if line.endswith("\n") else f"{prefix} {line}\n")
            sys.stdout.flush()


def launch(argv: list[str], *, processes: int, devices_per_process: int, port: int | None = None,
           timeout: float | None = None, grace: float = 10.0) -> int:
    """Runs `argv` in `processes` local processes; returns 0 or the first failing exit status.

    Args:
      argv: the command; a leading ``*.py`` runs with this Python interpreter.
      processes: how many processes.
      devices_per_process: CPU devices of each process.
      port: the coordinator's port (default: a free one).
      timeout: seconds before every process is killed (status 124).
      grace: seconds the others get to finish after one fails, before they are killed.
    """
    port = port or free_port()
    lock = threading.Lock()
    procs, threads = [], []
    for i in range(processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=_xla_flags(devices_per_process),
                   SOAPJAX_COORDINATOR=f"127.0.0.1:{port}", SOAPJAX_NUM_PROCESSES=str(processes),
                   SOAPJAX_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(_command(argv), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        t = threading.Thread(target=_stream, args=(proc, f"[p{i}]", lock), daemon=True)
        t.start()
        procs.append(proc)
        threads.append(t)
    status = _wait(procs, timeout=timeout, grace=grace)
    for t in threads:
        t.join(timeout=5)
    return status


def _wait(procs: list[subprocess.Popen], *, timeout: float | None, grace: float) -> int:
    start = time.monotonic()
    failed_at = None
    status = 0
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        for i, p in enumerate(procs):
            rc = p.poll()
            if rc not in (None, 0) and status == 0:
                status, failed_at = rc, now
                print(f"[launch] process {i} exited with status {rc}; stopping the others",
                      file=sys.stderr, flush=True)
        if timeout is not None and now - start > timeout:
            print(f"[launch] timeout after {timeout:.0f}s; killing every process", file=sys.stderr,
                  flush=True)
            _kill(procs)
            return 124
        if failed_at is not None and now - failed_at > grace:
            _kill(procs)
        time.sleep(0.05)
    for i, p in enumerate(procs):
        if p.returncode != 0 and status == 0:
            status = p.returncode
            print(f"[launch] process {i} exited with status {p.returncode}", file=sys.stderr,
                  flush=True)
    return status


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        ours, command = argv[:split], argv[split + 1:]
    else:
        ours, command = argv, []
    parser = argparse.ArgumentParser(
        description="Run a command in N local JAX processes (jax.distributed on 127.0.0.1).",
        usage="%(prog)s [--processes N] [--devices-per-process K] [--port P] [--timeout S] "
              "-- COMMAND [ARGS...]")
    parser.add_argument("--processes", type=int, default=2, help="default: %(default)s")
    parser.add_argument("--devices-per-process", type=int, default=4, help="default: %(default)s")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds, then kill all")
    args = parser.parse_args(ours)
    if not command:
        parser.error("no command given; put it after '--'")
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be at least 1")
    print(f"[launch] {args.processes} processes x {args.devices_per_process} CPU devices: "
          f"{shlex.join(command)}", flush=True)
    return launch(command, processes=args.processes, devices_per_process=args.devices_per_process,
                  port=args.port, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())

"""The compiling subprocess of `soapjax.cost.reshard`: both ends of its JSON-lines protocol.

The parent (`Worker`) starts ``python -m soapjax.measure._reshard_worker`` with N virtual CPU
devices, writes one batch of transitions per line (mesh axes by position), and reads one answer per
transition (``{"i": ..., "collectives": [...]}`` or ``{"i": ..., "error": ...}``), then
``{"done": true}``; protocol lines on stdout carry a prefix, so stray prints cannot confuse it.
The worker (`main`) compiles up to `CHUNK` transitions per program and reads the collectives
from the compiled HLO (`soapjax.measure.hlo`). The how and why are in `soapjax.cost.reshard`'s
module doc.
"""

from __future__ import annotations

import json
import math
import os
import re
import selectors
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from soapjax.measure import hlo

CHUNK = 32  # transitions per compiled program
_MARK = "@soapjax "  # prefix of the worker's protocol lines on stdout
_COMPILE_OPTIONS = {
    # Backend code generation only; the SPMD partitioner runs before these matter.
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
    "xla_cpu_parallel_codegen_split_count": 1,
    # The combiner would merge the all-reduces of different transitions of one program.
    "xla_disable_hlo_passes": "all-reduce-combiner,cpu-all-reduce-combiner",
}


# --- the compiling subprocess: parent side -------------------------------------------------------


class Worker:
    """A subprocess with N virtual CPU devices that compiles batches of transitions."""

    def __init__(self, num_devices: int):
        env = dict(os.environ)
        flags = [
            f
            for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        flags.append(f"--xla_force_host_platform_device_count={num_devices}")
        env["XLA_FLAGS"] = " ".join(flags)
        env["JAX_PLATFORMS"] = "cpu"
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"  # XLA's warnings ("Involuntary full rematerialization")
        root = str(Path(__file__).resolve().parents[2])  # the folder holding soapjax/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by the finalizer
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "soapjax.measure._reshard_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
        )
        self._buf = b""
        self.ready = False  # jax imported and the devices up
        self._finalizer = weakref.finalize(self, _kill, self._proc, self._stderr)

    def request(self, payload: dict, timeout: float) -> tuple[dict[int, dict], str | None]:
        """Send one batch; the results that came back, and what went wrong (None if nothing)."""
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        try:
            self._send((json.dumps(payload) + "\n").encode(), deadline)
            while True:
                msg = json.loads(self._readline(deadline))
                if msg.get("ready"):
                    self.ready = True
                elif msg.get("done"):
                    return got, None
                else:
                    got[int(msg["i"])] = msg
        except TimeoutError:
            return got, f"timeout: the batch took more than {timeout:.0f} s"
        except (OSError, EOFError, ValueError) as e:
            return got, (
                f"crash of the compiling subprocess ({type(e).__name__}: {e}); "
                f"its stderr ends: {self._stderr_tail()}"
            )

    def _send(self, data: bytes, deadline: float) -> None:
        # Non-blocking, so that a subprocess that stops reading cannot hang us past the deadline.
        fd = self._proc.stdin.fileno()
        os.set_blocking(fd, False)
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_WRITE)
            while data:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    raise TimeoutError
                try:
                    data = data[os.write(fd, data) :]
                except BlockingIOError:
                    continue

    def _readline(self, deadline: float) -> str:
        fd = self._proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                while b"\n" in self._buf:
                    line, self._buf = self._buf.split(b"\n", 1)
                    text = line.decode(errors="replace")
                    if text.startswith(_MARK):
                        return text[len(_MARK) :]
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    raise TimeoutError
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError("the subprocess exited")
                self._buf += chunk

    def _stderr_tail(self) -> str:
        try:
            self._stderr.seek(0, os.SEEK_END)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - 800))
            return self._stderr.read().decode(errors="replace").strip() or "(empty)"
        except (OSError, ValueError):
            return "(unreadable)"

    def close(self) -> None:
        self._finalizer()


def _kill(proc: subprocess.Popen, stderr: Any) -> None:
    # The worker holds nothing worth a graceful exit, and may be stuck in a compilation.
    try:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            pipe.close()
    except OSError:
        pass
    finally:
        stderr.close()


# --- the compiling subprocess: worker side -------------------------------------------------------


def main() -> None:
    """Read batches (JSON lines) from stdin; answer each transition, then ``{"done": true}``."""
    jax.config.update("jax_enable_x64", True)  # uint64 stays uint64
    jax.devices()
    _emit({"ready": True})
    options = dict(_COMPILE_OPTIONS)
    for line in sys.stdin:
        request = json.loads(line)
        sizes = tuple(request["mesh"])
        mesh = _jax_mesh(sizes)
        items = request["items"]
        for start in range(0, len(items), CHUNK):
            chunk = items[start : start + CHUNK]
            for i, result in _compile_chunk(mesh, chunk, request["rs"], options):
                _emit({"i": start + i, **result})
        _emit({"done": True})


def _emit(msg: dict) -> None:
    sys.stdout.write(_MARK + json.dumps(msg) + "\n")
    sys.stdout.flush()


def _jax_mesh(sizes: tuple[int, ...]) -> Any:
    devices = np.array(jax.devices()[: math.prod(sizes)]).reshape(sizes)
    names = tuple(f"ax{i}" for i in range(len(sizes)))
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(sizes))


def _compile_chunk(mesh: Any, items: list[dict], rs: bool, options: dict) -> list[tuple[int, dict]]:
    """One program for the chunk; one per transition if that fails or cannot be attributed."""
    if len(items) > 1:
        try:
            per_item = _collectives_by_item(mesh, items, rs, options)
            if per_item is not None:
                return [(i, {"collectives": c}) for i, c in enumerate(per_item)]
        except Exception:  # noqa: BLE001, S110 - isolate the failing transition below
            pass
    out = []
    for i, item in enumerate(items):
        try:
            per_item = _collectives_by_item(mesh, [item], rs, options)
            out.append((i, {"collectives": per_item[0]}))
        except Exception as e:  # noqa: BLE001 - reported, then the ideal model stands in
            out.append((i, {"error": f"{type(e).__name__}: {str(e)[:500]}"}))
    return out


def _collectives_by_item(
    mesh: Any, items: list[dict], rs: bool, options: dict
) -> list[list] | None:
    text = _compile_text(mesh, items, options)
    names = mesh.axis_names
    sizes = tuple(mesh.shape[n] for n in names)
    per_item: list[list] = [[] for _ in items]
    for c in hlo.collectives(text, mesh, reduce_scatter_from_slices=rs):
        tag = re.search(r"soapjax_t(\d+)/", c.op_name)
        combined = c.kind != "all-to-all" and len(c.shapes) > 1  # a combiner merged some
        if len(items) > 1 and (tag is None or int(tag.group(1)) >= len(items) or combined):
            return None  # cannot say whose it is: compile one by one
        i = int(tag.group(1)) if len(items) > 1 else 0
        if c.axes is None:
            raise ValueError(f"{c.kind} {c.name} has devices outside the mesh")
        axes = [names.index(a) for a in c.axes]
        full = math.prod(sizes[a] for a in axes)
        gs = c.group_size if c.kind != "collective-permute" and c.group_size < full else 0
        per_item[i].append([c.kind.replace("-", "_"), c.nbytes, axes, gs])
    return per_item


def _compile_text(mesh: Any, items: list[dict], options: dict) -> str:
    names = mesh.axis_names

    def entry(axes: list[int]) -> Any:
        return tuple(names[a] for a in axes) or None

    in_shardings, avals, plans = [], [], []
    for item in items:
        dtype = np.dtype(item["dtype"])
        shape = tuple(item["shape"])
        src = [entry(d) for d in item["src"]]
        if item["partial"]:
            # A leading dim of partial sums, one per device along the partial axes.
            lead = math.prod(mesh.shape[names[a]] for a in item["partial"])
            shape = (lead, *shape)
            src = [entry(item["partial"]), *src]
        in_shardings.append(NamedSharding(mesh, PartitionSpec(*src)))
        avals.append(jax.ShapeDtypeStruct(shape, dtype))
        dst = NamedSharding(mesh, PartitionSpec(*[entry(d) for d in item["dst"]]))
        plans.append((bool(item["partial"]), dtype, dst))

    def program(*xs: Any) -> list[Any]:
        outs = []
        for i, (x, (partial, dtype, dst)) in enumerate(zip(xs, plans)):
            with jax.named_scope(f"soapjax_t{i}"):
                if partial:
                    x = lax.reduce(x, np.zeros((), dtype), lax.add, (0,))
                outs.append(lax.with_sharding_constraint(x, dst))
        return outs

    lowered = jax.jit(program, in_shardings=in_shardings).lower(*avals)
    while True:
        try:
            return lowered.compile(options or None).as_text()
        except Exception as e:  # an option this jaxlib does not know: drop it, once
            unknown = re.search(r"No such compile option: '([^']+)'", str(e))
            if not unknown or unknown.group(1) not in options:
                raise
            del options[unknown.group(1)]


if __name__ == "__main__":
    main()

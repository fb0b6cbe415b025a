"""The `soapjax` command line: a thin layer over the public API, with no logic of its own.

Each subcommand has an `_add_<name>(subparsers)` that declares its arguments and a handler
`_cmd_<name>(args) -> int`. Run `soapjax --help` or `soapjax COMMAND --help`.

One module past ~600 lines, on purpose: it is one stage (argument parsing and printing), its
commands share their argument types and helpers, and reading `soapjax --help` against one file
is easier than against nine. Every command imports its library modules inside the handler, so
``soapjax --help`` starts without importing jax.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence

from soapjax.base._progress import end_progress, print_progress
from soapjax.base.errors import SettingsError, SoapjaxError

__all__ = ["BROKEN_PIPE", "CHECK_FAILED", "INTERRUPTED", "build_parser", "main"]

_EPILOG = """\
typical use:
  soapjax models                           the model zoo, with parameter counts and FLOPs
  soapjax graph --model gpt2               the operator graph soapjax searches over
  soapjax meshes                           the shipped cluster topologies
  soapjax mesh show dgx-h100x8             devices, mesh axes, links, bandwidth per axis
"""


def _print_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


# --- arguments shared by several commands -------------------------------------------------------

_MODEL_HELP = ("a zoo model (see `soapjax models`), or your own code: path/to/file.py:FUNCTION "
               "or package.module:FUNCTION, a function returning (loss_fn, params or nnx.Module, "
               "batch[, optimizer]) (default: %(default)s)")


def _number(kind: type, low: float, what: str, high: float = math.inf):
    """An argparse type: a finite `kind` from `low` to `high`; anything else is a usage error
    (exit 2)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


class _OneWay(argparse.BooleanOptionalAction):
    """``--flag`` / ``--no-flag``, refusing both on one command line (the last would win
    silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = f"_given_{self.dest}"
        if getattr(namespace, seen, None) not in (None, option_string):
            parser.error(f"{getattr(namespace, seen)} and {option_string} contradict each "
                         "other; give one of them")
        setattr(namespace, seen, option_string)
        super().__call__(parser, namespace, values, option_string)


def _check_cache_dir(path: str | None) -> None:
    """SettingsError unless `path` (a --cache-dir) is a directory or can become one."""
    if path is None:
        return
    from pathlib import Path

    p = Path(path)
    folder = p
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise SettingsError(f"--cache-dir {path}: {folder} is a file; expected a directory for "
                            "the cost cache (it is made if missing)")


def _check_output(option: str, path: str | None, suffix: str) -> None:
    """SettingsError before any work unless `path` (an --OPTION file to write) is a file path
    in a directory that exists or can be made (not a directory itself)."""
    if path is None:
        return
    from soapjax.base._paths import unwritable

    why, folder = unwritable(path)
    if why == "directory":
        raise SettingsError(f"{option} {path}: a directory; expected a file path, e.g. "
                            f"{folder / ('timeline' + suffix)}")
    if why:
        raise SettingsError(f"{option} {path}: cannot write there ({folder} is {why})")


def _add_size(p: argparse.ArgumentParser, default: str | None, help: str) -> None:
    """--size (a zoo model's size: default, tiny, ...), with --config its deprecated old name."""
    p.add_argument("--size", "--config", dest="size", default=default,
                   help=help + "; --config is a deprecated alias of --size")


_SECONDS = _number(float, 0.0, "a number of seconds >= 0")
_COUNT = _number(int, 1, "an integer >= 1")
_SEED = _number(int, 0, "an integer >= 0")


def _load_model(model: str, config: str, api: str | None = None,
                batch_size: int | None = None):
    """The workload `--model` names: a zoo model or user code (`soapjax_zoo.load`), with
    `--batch-size` samples per step where given."""
    import soapjax_zoo as zoo

    return zoo.load(model, config, api=api, batch_size=batch_size)


_MESH_CUT = ("; NAME-N is its first N devices, whole nodes (dgx-a100x3072-512: 64 DGX A100s) "
             "or part of one")


def _add_batch_size(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=_COUNT, default=None, help="samples per step instead "
                   "of the model size's (zoo models), e.g. Megatron's global batch of 512")


def _trace(w, name: str | None = None):
    """`w`'s graph, with the parameters its optimizer freezes marked (`freeze`)."""
    from soapjax.cost.updates import freeze
    from soapjax.graph.opgraph import trace

    return freeze(trace(w.loss_fn, w.abstract_params(), w.abstract_batch(),
                        name=name or w.name, has_aux=w.has_aux), w.optimizer)


def _workload_text(model: str) -> str:
    """What a plan records to rebuild user code ('' for the zoo, which goes by name)."""
    from soapjax_zoo.user import is_user_code

    return model if is_user_code(model) else ""


# --- models -------------------------------------------------------------------------------------


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list the model zoo with parameter counts and FLOPs per step",
        description="List every registered model with its configs, parameter count and FLOPs "
        "per training step (forward, backward and optimizer update, as XLA counts them).",
    )
    _add_size(p, "default", "which model size to summarise (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_models)


def _cmd_models(args: argparse.Namespace) -> int:
    import soapjax_zoo as zoo

    rows = []
    for name in zoo.names_with(args.size):  # a size only some models have lists those
        s = zoo.summarize(zoo.get(name, args.size))
        rows.append(
            {
                "name": name,
                "config": args.size,
                "configs": list(zoo.configs(name)),
                "family": s.family,
                "batch_size": s.batch_size,
                "param_count": s.param_count,
                "flops_per_step": s.flops_per_step,
                "description": s.description,
            }
        )
    if args.json:
        _print_json(rows)
        return 0
    print(f"{'model':<14}{'family':<13}{'batch':>6}{'params':>14}{'GFLOP/step':>13}  description")
    for r in rows:
        print(
            f"{r['name']:<14}{r['family']:<13}{r['batch_size']:>6}{r['param_count']:>14,}"
            f"{r['flops_per_step'] / 1e9:>13,.1f}  {r['description']}"
        )
    return 0


# --- graph --------------------------------------------------------------------------------------


def _add_graph(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "graph",
        help="print a model's operator graph (operators, dim roles, FLOPs, tensors)",
        description="Trace a model's loss to a jaxpr and print its operator graph: one row "
        "per operator with its anchor primitive, output shape with dim roles (S sample, A "
        "attribute, P parameter, - not divisible), splittable reduction dims (R), forward "
        "FLOPs and parameter bytes.",
    )
    p.add_argument("--model", default="gpt2", help=_MODEL_HELP)
    _add_size(p, "default", "zoo model size, e.g. default or tiny")
    p.add_argument("--api", default=None, choices=("linen", "nnx"),
                   help="Flax API of a zoo model (default: linen)")
    p.add_argument("--json", action="store_true", help="print the graph as JSON")
    p.set_defaults(func=_cmd_graph)


def _cmd_graph(args: argparse.Namespace) -> int:
    g = _trace(_load_model(args.model, args.size, args.api))
    if args.json:
        _print_json(g.to_json())
    else:
        print(g.table())
    return 0


# --- meshes, mesh show --------------------------------------------------------------------------


def _add_meshes(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "meshes",
        help="list the shipped cluster topologies",
        description="List the shipped topologies (soapjax/topology/meshes/): name, devices, mesh "
                    "axes, device kind.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_meshes)


def _cmd_meshes(args: argparse.Namespace) -> int:
    from soapjax.topology import cluster as topology

    rows = []
    for name in topology.list_topologies():
        t = topology.load_topology(name)
        axes = dict(zip(t.axis_names, t.axis_sizes))
        rows.append(
            {
                "name": name,
                "platform": t.platform,
                "num_devices": t.num_devices,
                "axes": axes,
                "device_kind": t.device.kind,
            }
        )
    if args.json:
        _print_json(rows)
        return 0
    texts = [", ".join(f"{a}={n}" for a, n in r["axes"].items()) for r in rows]
    width = max(len(t) for t in texts + ["axes"]) + 2
    print(f"{'name':<14}{'platform':<10}{'devices':>8}  {'axes':<{width}}device")
    for r, axes in zip(rows, texts):
        print(f"{r['name']:<14}{r['platform']:<10}{r['num_devices']:>8}  {axes:<{width}}"
              f"{r['device_kind']}")
    return 0


def _add_mesh(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mesh", help="inspect one topology (see `soapjax mesh show --help`)")
    mesh_sub = p.add_subparsers(dest="mesh_command", metavar="SUBCOMMAND", required=True)
    show = mesh_sub.add_parser(
        "show",
        help="devices, mesh axes, links and the bandwidth each axis sees",
        description="Print a topology: its devices, its mesh axes with the per-device "
        "bandwidth (GB/s = gigabytes/s; Gb/s = gigabits/s) and latency a ring collective over "
        "each axis alone gets with all its groups running at once, and its links by kind.",
    )
    show.add_argument("name", help="a shipped topology (see `soapjax meshes`) or a .toml path")
    show.add_argument("--json", action="store_true", help="print JSON instead of text")
    show.set_defaults(func=_cmd_mesh_show)


def _cmd_mesh_show(args: argparse.Namespace) -> int:
    from soapjax.topology import cluster as topology

    s = topology.load_topology(args.name).summary()
    if args.json:
        _print_json(s)
        return 0
    d = s["device"]
    flops = ", ".join(f"{k} {v:g}" for k, v in d["peak_tflops"].items())
    print(f"{s['name']}: {s['description']}")
    print(
        f"  {s['num_devices']} {s['platform']} devices = {s['num_nodes']} "
        f"node{'s' if s['num_nodes'] != 1 else ''} x "
        f"{s['devices_per_node']}, each {d['kind']}: {d['memory_GB']:g} GB at "
        f"{d['memory_bandwidth_GBps']:g} GB/s; peak TFLOP/s {flops}"
    )
    print(f"  from {s['source_file']}, fingerprint {s['fingerprint'][:16]}")
    print(f"\n  {'axis':<8}{'size':>5}{'GB/s':>10}{'Gb/s':>10}{'latency':>10}  bottleneck")
    for a in s["axes"]:
        b = a["bottleneck"]
        why = "-"
        if b is not None:
            shared = f" shared by {b['sharing']} ring flows" if b["sharing"] > 1 else ""
            why = f"{b['class']} {b['link']} ({b['link_bandwidth_GBps']:g} GB/s{shared})"
        print(
            f"  {a['name']:<8}{a['size']:>5}{a['bandwidth_GBps']:>10.4g}"
            f"{a['bandwidth_gbps']:>10.4g}{a['latency_us']:>8.3g}us  {why}"
        )
    print(f"\n  {'links':<16}{'count':>6}{'GB/s':>10}{'latency':>10}")
    for k in s["links"]:
        print(
            f"  {k['class']:<16}{k['count']:>6}{k['bandwidth_GBps']:>10.4g}"
            f"{k['latency_us']:>8.3g}us"
        )
    print("  (GB/s: gigabytes per second, per direction; Gb/s: gigabits per second)")
    return 0


# --- calibrate, profile -------------------------------------------------------------------------


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="compare a measured training step with the sum of its measured operator times",
        description="On the local backend, time a zoo model's whole unsharded training step "
        "(one jitted program, many repetitions) and the sum of its operators' measured forward "
        "and backward times and its optimizer updates (the cost model's parts); print both "
        "and the error. Operator times come from (and fill) the cost cache.",
    )
    p.add_argument("--model", default="mlp", help="registry name, or 'all' for the whole zoo")
    _add_size(p, "tiny", "zoo model size (default: %(default)s)")
    p.add_argument("--cache-dir", default=None, help="cost cache (default: $SOAPJAX_CACHE_DIR "
                   "or ~/.cache/soapjax/costs)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--links", action="store_true",
                   help="instead: time every collective XLA emits over each mesh axis of --mesh "
                   "on the attached devices (256 B .. 64 MB, 19 sizes and 4 held back; short "
                   "trials in 3 passes, 7 for those under 50 ms; about 4 minutes on cpu8), how "
                   "many devices compute at once, whether collectives run beside compute "
                   "(comm_overlap; none on XLA:CPU) and what calling a step costs (per call and "
                   "per returned array, on a step-shaped program); per axis and collective, "
                   "join the measured times with straight lines (piecewise latency + "
                   "bytes/bandwidth), check them on sizes held back between the measured ones, "
                   "and print the [compute] and [[collectives]] tables (--write: into the "
                   "topology file)")
    p.add_argument("--mesh", default="cpu8", help="with --links: a shipped topology or a .toml "
                   "path (default: %(default)s)")
    p.add_argument("--write", action="store_true", help="with --links: rewrite the topology "
                   "file's measured tables")
    p.set_defaults(func=_cmd_calibrate)


# Set by the command line's Ctrl-C handler and cleared when the command ends: a Ctrl-C Python
# raised inside a callback that swallows exceptions (jax's garbage-collection callbacks print
# "Exception ignored" and go on) is raised again at the next progress line.
_CTRL_C = threading.Event()


@contextlib.contextmanager
def _ctrl_c_kept() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt and is remembered until the command ends (`_CTRL_C`):
    `_interruptible` progress callbacks raise it again if it was swallowed. Left alone where a
    caller has a handler of its own or Ctrl-C is ignored (a background job); taken over from
    the one ``import soapjax`` sets while the command line starts."""
    import signal

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None) or \
            (signal.getsignal(signal.SIGINT) is not signal.default_int_handler
             and getattr(signal.getsignal(signal.SIGINT), "__module__", "") != "soapjax"):
        yield
        return

    def handler(signum, frame):
        _CTRL_C.set()
        raise KeyboardInterrupt

    previous_hook = sys.unraisablehook

    def quiet(unraisable) -> None:
        # A Ctrl-C raised inside a callback that swallows it (an import lock's weakref
        # callback, a garbage-collection callback) would print "Exception ignored in ...
        # Traceback"; it is remembered (`_CTRL_C`) and raised again, so say nothing.
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous_hook(unraisable)

    signal.signal(signal.SIGINT, handler)
    sys.unraisablehook = quiet
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.unraisablehook = previous_hook
        _CTRL_C.clear()


def _interruptible(progress):
    """A progress callback that first raises a Ctrl-C swallowed since (`_ctrl_c_kept`); with
    `progress` None, only that."""
    def check(line: str) -> None:
        if _CTRL_C.is_set():
            raise KeyboardInterrupt
        if progress is not None:
            progress(line)

    return check


@contextlib.contextmanager
def _ctrl_c_ends_at_once(command: str) -> Iterator[None]:
    """Ctrl-C ends the process at once (one line, status 130), even inside a compiled call.

    Python turns Ctrl-C into KeyboardInterrupt only when the main thread next runs Python code,
    and a jitted call blocks in XLA until it returns: measured, a 15 s loop went on for 14.5 s
    after Ctrl-C, and calibrate --links times collectives in calls that can last that long. A
    thread wakes on the signal (`signal.set_wakeup_fd`) and exits; only for work that leaves
    nothing half-written (calibrate --links writes its file after this scope).
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        yield  # Ctrl-C ignored (a background job): leave it be
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if signal.SIGINT in os.read(read, 64) and not done.is_set():
                os.write(2, f"\nsoapjax {command}: interrupted\n".encode())
                os._exit(INTERRUPTED)
        os.close(read)

    threading.Thread(target=watch, name="soapjax-ctrl-c", daemon=True).start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        os.write(write, b"\0")  # wakes the thread, which sees `done` and ends
        os.close(write)


def _cmd_calibrate_links(args: argparse.Namespace) -> int:
    import jax

    from soapjax.measure import links
    from soapjax.topology import cluster as topology

    topo = topology.load_topology(args.mesh)
    log = (lambda s: None) if args.json else (lambda s: print(s, flush=True))
    with _ctrl_c_ends_at_once("calibrate"):
        fits, compute, seconds = links.calibrate_links(topo, log=log)
    dev = jax.devices()[0]
    command = f"soapjax calibrate --links --mesh {args.mesh} --write"
    if topo.capabilities.virtual_devices:  # as many as this process had (the tests: 8)
        command = (f"XLA_FLAGS=--xla_force_host_platform_device_count={len(jax.devices())} "
                   + command)
    notes = [(f"on {len(jax.devices())} x {dev.device_kind} ({dev.platform}), jax "
              f"{jax.__version__}, {seconds:.0f} s")]
    if args.json:
        _print_json({"seconds": seconds,
                     "compute": dataclasses.asdict(compute) if compute else None,
                     "collectives": [{"kind": f.model.kind, "axes": f.model.axes,
                                      "points": f.model.points, "residuals": f.residuals,
                                      "held_out": f.held_out} for f in fits]})
    else:
        print(links.format_measured(fits, compute, command=command, notes=notes))
        held = [abs(e) for f in fits for _, e in f.held_out]
        print(f"held-back sizes: |error| max {max(held):.0%}, mean {sum(held) / len(held):.0%} "
              "(the fit's time against the measured one, relative to the measured); "
              f"{seconds:.0f} s")
    if args.write:
        if topo.source_file is None:
            raise SettingsError(f"{args.mesh}: a topology cut from a shipped one has no file of "
                                "its own to write; give the whole topology's name or file")
        links.write_calibrated(topo.source_file, fits, compute, command=command, notes=notes)
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import soapjax_zoo as zoo
    from soapjax.cost import operators as cost

    if args.links:
        return _cmd_calibrate_links(args)
    if args.write:
        raise SettingsError("--write rewrites a topology file's measured collectives, so it "
                            "needs --links (soapjax calibrate --links --mesh NAME --write); "
                            "without --links calibrate compares a model's step with its parts "
                            "and writes nothing")
    _check_cache_dir(args.cache_dir)

    names = zoo.names() if args.model == "all" else (args.model,)
    rows = []
    if not args.json:
        print(f"{'model':<14}{'config':<9}{'ops':>5}{'step ms':>10}{'sum ms':>10}{'fwd':>9}"
              f"{'bwd':>9}{'update':>9}{'error':>8}")
    for name in names:
        c = cost.calibrate(zoo.get(name, args.size), cache_dir=args.cache_dir)
        rows.append({**c._asdict(), "sources": dict(c.sources), "predicted_s": c.predicted_s,
                     "error": c.error})
        if not args.json:
            print(f"{c.model:<14}{c.config:<9}{c.num_operators:>5}{c.step_s * 1e3:>10.3f}"
                  f"{c.predicted_s * 1e3:>10.3f}{c.forward_s * 1e3:>9.3f}{c.backward_s * 1e3:>9.3f}"
                  f"{c.update_s * 1e3:>9.3f}{c.error:>+8.0%}", flush=True)
    if args.json:
        _print_json(rows)
    else:
        print("error = (sum - step) / step: how far the sum of the operators' measured times "
              "(fwd + bwd + update) is from the measured whole step; +100% is a sum twice the "
              "step, -50% half of it")
    return 0


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="measure every operator shard shape the search can visit (fills the cost cache)",
        description="Price every config of every operator of a model on a topology's mesh: "
        "measure each distinct shard program (by signature) on the local backend when it "
        "matches the topology, or use the analytic roofline when it does not.",
    )
    p.add_argument("--model", default="gpt2", help="registry name (see `soapjax models`)")
    _add_size(p, "default", "zoo model size, e.g. default or tiny")
    p.add_argument("--mesh", default="cpu8", help="a shipped topology or a .toml path")
    p.add_argument("--mode", default="auto", choices=("auto", "measured", "analytic"),
                   help="how to price operators (default: measured if the devices are here)")
    p.add_argument("--cache-dir", default=None, help="cost cache (default: $SOAPJAX_CACHE_DIR "
                   "or ~/.cache/soapjax/costs)")
    p.set_defaults(func=_cmd_profile)


def _cmd_profile(args: argparse.Namespace) -> int:
    from soapjax.cost import operators as cost
    from soapjax.topology import cluster as topology

    _check_cache_dir(args.cache_dir)
    w = _load_model(args.model, args.size)
    g = _trace(w)
    topo = topology.load_topology(args.mesh)
    costs = cost.cost_model(g, topo, mode=args.mode, cache_dir=args.cache_dir,
                            optimizer=w.optimizer)

    def progress(p: cost.ProfileProgress) -> None:
        print_progress(f"{p.done}/{p.total} shard programs, {p.distinct} distinct, "
                       f"{p.measured} measured, {p.elapsed_s:.1f}s")

    r = costs.profile(progress=progress)
    end_progress()
    print(f"{w.name} ({args.size}) on {topo.name}: {costs.source} costs; {r.pairs} "
          f"(operator, config) pairs, {r.shard_programs} shard programs, {r.distinct} distinct "
          f"signatures; {r.measured} measured now, {r.fallbacks} fallbacks; {r.seconds:.1f}s")
    return 0


# --- pictures (simulate --plot, plan --plot) ----------------------------------------------------

_PLOT_HELP = ("write pictures: OUT.png (each operator's split over the devices, as in the "
              "paper's Figures 13/14), OUT-timeline.png (the simulated timeline per device and "
              "link)")


def _require_plot(path: str) -> None:
    """Fails before any work when matplotlib is missing or cannot write `path`'s format; files
    need no display (Agg)."""
    from soapjax.plot import check_picture_path, require_matplotlib

    require_matplotlib(backend="Agg")
    check_picture_path(path)


def _save_plot(path, graph, strategy, topology, sim, comparison=None) -> list:
    from soapjax.plot import save_pictures

    return save_pictures(path, graph, strategy, topology, sim, comparison)


# --- simulate -----------------------------------------------------------------------------------


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from soapjax.cost.reshard import DEFAULT_MODE
    from soapjax.strategy.baselines import NAMES

    p = sub.add_parser(
        "simulate",
        help="predict a strategy's training step time, communication and memory per device",
        description="Simulate one training step of a model under a strategy on a topology "
        "(FlexFlow's execution simulator on one SPMD program): forward, backward, gradient "
        "synchronisation and optimizer-update tasks on the compute stream, collectives on the "
        "topology's links. Prints the step time, its breakdown, bytes moved per link class and "
        "peak memory per device; --trace writes the timeline for Perfetto / chrome://tracing.",
    )
    p.add_argument("--model", default=None, help=_MODEL_HELP.replace(
        "%(default)s", "the plan's model when --strategy is a plan file, else gpt2"))
    _add_size(p, None, "zoo model size, e.g. default or tiny "
                   "(default: the plan's, else default)")
    p.add_argument("--mesh", default=None, help="a shipped topology or a .toml path (default: "
                   "the plan's topology when --strategy is a plan file, else cpu8)" + _MESH_CUT)
    _add_batch_size(p)
    p.add_argument("--strategy", default="data-parallel",
                   help=f"a baseline ({', '.join(NAMES)}), a plan file from `soapjax plan`, or "
                   'a JSON file {"configs": {operator: [[axes of dim 0], ...]}, "zero_axes": '
                   "[...]} overriding data parallelism operator by operator "
                   "(default: %(default)s)")
    p.add_argument("--costs", default="auto", choices=("auto", "measured", "analytic"),
                   help="operator times: measured on this backend or the analytic roofline "
                   "(default: measured if the topology's devices are here)")
    p.add_argument("--reshard", default=DEFAULT_MODE, choices=("ideal", "xla"),
                   help="which collectives a resharding costs: the ideal model, or what XLA "
                   "compiles (cached) (default: %(default)s, as `soapjax plan`)")
    p.add_argument("--trace", metavar="OUT.json", help="write the timeline as Chrome trace JSON")
    p.add_argument("--plot", metavar="OUT.png", help=_PLOT_HELP + " (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_cmd_simulate)


def _simulate_inputs(args: argparse.Namespace):
    """The workload and topology to simulate: as given, else the plan file's, else the
    defaults (gpt2, cpu8)."""
    from soapjax.strategy.plan import FORMAT, Plan
    from soapjax.topology.cluster import load_topology

    model, config, mesh = args.model, args.size, args.mesh
    if (model is None or mesh is None) and args.strategy.endswith(".json"):
        try:
            with open(args.strategy) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = None  # parse_strategy says what is wrong with the file
        if isinstance(data, dict) and data.get("format") == FORMAT:
            plan = Plan.from_json(data, where=args.strategy)
            if model is None:
                model, config = plan.workload or plan.model, config or plan.model_config or None
                if args.batch_size is None and plan.batch_size and not plan.workload:
                    args.batch_size = plan.batch_size  # the zoo model at the plan's batch
            mesh = mesh or plan.topology
    return (_load_model(model or "gpt2", config or "default", batch_size=args.batch_size),
            load_topology(mesh or "cpu8"))


def _cmd_simulate(args: argparse.Namespace) -> int:
    from soapjax.cost import operators as cost
    from soapjax.report import format_bytes, sent_bytes, step_terms
    from soapjax.simulate import front as simulate
    from soapjax.strategy.plan import untied_warning

    if args.plot:
        _require_plot(args.plot)
    _check_output("--trace", args.trace, ".json")
    w, topo = _simulate_inputs(args)
    g = _trace(w)
    strategy = simulate.parse_strategy(g, topo, args.strategy, family=w.family)
    costs = cost.cost_model(g, topo, mode=args.costs, optimizer=w.optimizer)
    factor = simulate.opt_state_factor(w.optimizer, w.abstract_params())
    r = simulate.simulate(g, topo, strategy, cost_model=costs, resharder=args.reshard,
                          opt_state_factor=factor)
    notes = _pipeline_notes(strategy, r)
    untied = untied_warning(g, strategy)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(r.to_chrome_trace(), f)
    pictures = _save_plot(args.plot, g, strategy, topo, r) if args.plot else []
    warnings = [x for x in (untied, _stage_permute_warning(r)) if x]
    if args.json:
        _print_json(r.to_json() | {"warnings": warnings})
        return 0
    notes += warnings
    m = r.memory
    sent, by_class = sent_bytes(r)
    links = ", ".join(f"{k} {format_bytes(v)}" for k, v in by_class.items()) or "none"
    config = f" ({w.config})" if w.config else ""
    print(f"{w.name}{config} on {topo.name} ({r.num_devices} devices), {args.strategy}:")
    terms = " + ".join(f"{name} {t * 1e3:.4g} ms" for name, t in step_terms(r))
    print(f"  step time  {r.step_time_s * 1e3:.4g} ms = {terms} ({r.cost_source} costs)")
    contention = r.contention_s / (r.pipeline.timeline.stages if r.pipeline else 1)
    if contention > 0:  # (a pipelined step's: a device's share, as its compute)
        print(f"  contention {contention * 1e3:.4g} ms of the compute: kernels slowed beside "
              f"running collectives ([device.kernels].overlap_slowdown)")
    print(f"  sent       {format_bytes(sent)} per device ({links})")
    for line in notes:
        print("  " + line)
    print(f"  memory     {format_bytes(m.total)} per device of "
          f"{format_bytes(r.memory_capacity_bytes)}: "
          f"{'fits' if r.fits_in_memory else 'DOES NOT FIT'} (params {format_bytes(m.params)}, "
          f"grads {format_bytes(m.grads)}, optimizer {format_bytes(m.opt_state)}, activations "
          f"{format_bytes(m.activations)}, communication buffers {format_bytes(m.comm_buffers)}"
          + (f", constants {format_bytes(m.constants)}" if m.constants else "") + ")")
    if args.trace:
        print(f"  trace      {args.trace} ({len(r.tasks)} tasks; open in https://ui.perfetto.dev)")
    if pictures:
        print(f"  pictures   {', '.join(map(str, pictures))}")
    return 0


# --- plan ---------------------------------------------------------------------------------------


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from soapjax.cost.reshard import DEFAULT_MODE
    from soapjax.search import MAX_BUDGET_S, MAX_PROPOSALS, SearchSettings

    p = sub.add_parser(
        "plan",
        help="search for a fast sharding of a model on a cluster and write a plan file",
        description="Trace a model (from the zoo, or your own code), search its SOAP space on "
        "a cluster topology with MCMC (scored by the execution simulator), print the plan "
        "against every baseline (data parallel, Megatron, FSDP, the paper's experts) and write "
        "it as JSON. With no arguments: GPT-2 small on one DGX H100 (analytic costs, since no "
        "H100 is attached).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  soapjax plan\n  soapjax plan --model nmt --mesh k80x64 --budget 60"
        "\n  soapjax plan --model mlp --size tiny --mesh cpu8 --costs measured --out mlp.json"
        "\n  soapjax plan --model my_model.py:make_workload --mesh cpu8"
        "\n  soapjax plan --model gpt --size 13b --mesh dgx-a100x3072-512 --batch-size 512",
    )
    p.add_argument("--model", default="gpt2", help=_MODEL_HELP)
    _add_size(p, "default", "zoo model size (default: "
                   "%(default)s)")
    p.add_argument("--mesh", default="dgx-h100x8", help="topology name or TOML path "
                   "(default: %(default)s; see `soapjax meshes`)" + _MESH_CUT)
    _add_batch_size(p)
    p.add_argument("--budget", default=None, type=_number(
        float, 0.0, f"a number of seconds from 0 to {MAX_BUDGET_S} (a week)", MAX_BUDGET_S),
        help=f"search time in seconds (default: {SearchSettings.budget_s:g}); it bounds the "
        "search, measuring included, not loading or tracing your model (a model function that "
        "never returns is yours to stop with Ctrl-C)")
    p.add_argument("--proposals", type=_number(int, 1, f"an integer from 1 to "
                                                        f"{MAX_PROPOSALS:,}", MAX_PROPOSALS),
                   default=None, help="proposals per chain instead of a time budget: the same "
                   "plan on any machine (not with --budget)")
    p.add_argument("--seed", type=_SEED, default=SearchSettings.seed,
                   help="random seed (default: %(default)s)")
    p.add_argument("--processes", type=_number(int, 1, "an integer from 1 to 1024", 1024),
                   default=None, help="processes that run the search's chains side by side "
                   "(default: one per core; 1: all in this one). Any number gives the same plan "
                   "with --proposals; with a time budget, more processes walk further. With "
                   "measured costs the chains stay in this process")
    p.add_argument("--costs", default="auto", choices=("auto", "measured", "analytic"),
                   help="operator times: measured on the local backend, or the roofline of the "
                   "topology's device (auto: measured when the topology's devices are attached)")
    p.add_argument("--reshard", default=DEFAULT_MODE, choices=("ideal", "xla"),
                   help="resharding collectives: an ideal model, or what XLA compiles "
                   "(slower the first time; cached) (default: %(default)s; the search's few "
                   "best plans are then priced again with what XLA compiles, and the fastest "
                   "so priced wins)")
    p.add_argument("--no-reshard-check", action="store_true",
                   help="with --reshard ideal, keep the search's best plan as the ideal model "
                   "prices it: no XLA compile of its reshardings")
    p.add_argument("--no-reduction", action="store_true",
                   help="never split reduction dims (FlexFlow's own space)")
    p.add_argument("--pipelines", action=_OneWay, default=None,
                   help="search pipeline stages too (the outermost mesh axis cut into stages; "
                   "1F1B and interleaved 1F1B as Megatron's grid, then GPipe or the "
                   "zero-bubble schedules, their stash lean or gathered, where faster), for "
                   "models of many layers on many "
                   "nodes; "
                   "--no-pipelines never; default: only when no plan without stages fits. "
                   "`soapjax.apply.step` runs pipelined plans on one mesh with a stage axis")
    p.add_argument("--out", default=None, help="plan file to write "
                   "(default: plans/MODEL-CONFIG-MESH.json)")
    p.add_argument("--trace", default=None, help="write the plan's simulated timeline as "
                   "Chrome trace JSON (open in Perfetto or chrome://tracing)")
    p.add_argument("--plot", metavar="OUT.png", help=_PLOT_HELP + ", and OUT-baselines.png "
                   "(step time and bytes against the baselines); needs matplotlib")
    p.add_argument("--json", action="store_true", help="print JSON instead of the report")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    import time

    from soapjax.report import plan_report, sent_bytes
    from soapjax.strategy.baselines import batch_split_note
    from soapjax.strategy.plan import check_plan_path
    from soapjax.strategy.space import MeshShape
    from soapjax.topology.cluster import load_topology, stage_topology

    if args.plot:
        _require_plot(args.plot)
    _check_output("--trace", args.trace, ".json")
    w = _load_model(args.model, args.size, batch_size=args.batch_size)
    topo = load_topology(args.mesh)
    name = f"{args.model}-{args.size}" if w.config else w.name
    name += f"-b{args.batch_size}" if args.batch_size else ""
    out = args.out or f"plans/{name}-{topo.name}.json"
    check_plan_path(out)  # before the search, not after it
    t0 = time.perf_counter()
    g = _trace(w)
    plan, sim, others, cost_source, notes = _search_and_simulate(args, w, g, topo)
    strategy, info = plan.strategy(g, topo), dict(plan.search)
    _interruptible(None)("")  # a Ctrl-C swallowed since the last progress line: nothing written
    out = plan.save(out)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(sim.to_chrome_trace(), f)
    pictures = []
    if args.plot:
        drawn = stage_topology(topo, strategy.stages)  # a pipelined plan: one stage's devices
        pictures = _save_plot(args.plot, g, strategy, drawn, sim, {"soapjax plan": sim} | others)
    if args.json:
        _print_json({"step_time_s": sim.step_time_s, "baselines": dict(plan.baselines),
                     "search_time_s": info["search_time_s"], "proposals": info["proposals"],
                     "fits_in_memory": sim.fits_in_memory, "plan_file": str(out),
                     "cost_source": cost_source, "bytes_moved": sent_bytes(sim)[0],
                     "estimated_operators": list(info.get("estimated_operators") or ()),
                     "peak_memory_bytes": list(sim.peak_memory_bytes)})
        return 0
    header = _plan_header(args, w, g, topo, info, cost_source, time.perf_counter() - t0)
    header += notes
    if note := _estimated_note(info, str(out)):
        header.append(note)
    if note := batch_split_note(g, MeshShape.of(topo)):
        header += [f"note: {note}; the data-parallel baseline is replicated"]
    if g.has_aux:
        header += ["note: the loss returns values beside it (planned as has_aux=True: run it "
                   "with shard_training(..., has_aux=True)), so the plan keeps one microbatch "
                   "and no pipeline stages" + (" (--pipelines has no effect)"
                                              if args.pipelines else "")]
    fits = dict(info["baselines_fit"])
    baselines = [(n, t, fits.get(n, True)) for n, t in plan.baselines]
    print(plan_report(g, topo, strategy, sim, baselines=baselines, header=header))
    print(f"plan written to {out}" + (f"; timeline to {args.trace}" if args.trace else ""))
    if pictures:
        print(f"pictures: {', '.join(map(str, pictures))}")
    return 0


def _search_and_simulate(args: argparse.Namespace, w, g, topo):
    """`find_plan` with the command's settings: (the plan, its `SimResult` as `find_plan`
    simulated it, the baselines' results (for --plot, with the same costs), where the costs
    came from, extra report lines (a pipelined plan's))."""
    from soapjax.cost.operators import cost_model
    from soapjax.cost.reshard import Resharder
    from soapjax.search import SearchSettings, find_plan
    from soapjax.strategy.space import MeshShape, SpaceLimits

    if args.budget is not None and args.proposals is not None:
        raise SettingsError("--budget stops the search on time and --proposals on a count "
                            "(the same plan on any machine); give one of them")
    budget = SearchSettings.budget_s if args.budget is None else args.budget
    settings = SearchSettings(budget_s=budget, max_proposals=args.proposals, seed=args.seed,
                              processes=args.processes,
                              limits=SpaceLimits(allow_reduction=not args.no_reduction),
                              pipelines=args.pipelines,
                              check_reshardings=not args.no_reshard_check)
    progress = _interruptible(None if args.json else print_progress)
    cm = cost_model(g, topo, mode=args.costs, optimizer=w.optimizer)
    with Resharder(MeshShape.of(topo), mode=args.reshard) as resharder:  # shared with the report
        plan = find_plan(g, topo, settings=settings, costs=cm, reshard=resharder,
                         optimizer=w.optimizer, family=w.family, model_config=w.config,
                         workload=_workload_text(args.model), progress=progress)
        if progress:
            end_progress()
        info = dict(plan.search)
        others = _baseline_results(g, topo, w, cm, resharder, info) if args.plot else {}
    return plan, plan.simulated, others, cm.source, _pipeline_notes(plan.strategy(g, topo),
                                                                   plan.simulated)


def _pipeline_notes(strategy, result) -> list[str]:
    """A pipelined step's report line: stages, schedule, bubble and memory by stage."""
    from soapjax.report import format_bytes

    p = result.pipeline
    if p is None:
        return []
    mem = ", ".join(format_bytes(m.total) for m in p.stage_memory)
    uneven = (f" of {'/'.join(map(str, strategy.stage_layers))} layers"
              if strategy.stage_layers else "")
    return [f"pipeline: {strategy.stages} stages{uneven} x {strategy.virtual_stages} virtual, "
            f"{strategy.schedule}, {strategy.microbatches} microbatches; bubble "
            f"{p.bubble_fraction:.1%}; memory per device by stage: {mem}; configs are over "
            "one stage's devices"]


def _stage_permute_warning(result) -> str | None:
    """A pipelined plan apply would refuse (its stages would hang), from the simulator's
    `PipelineResult.stage_permutes`; None for any other."""
    p = result.pipeline
    reads = p.stage_permutes if p is not None else ()
    if not reads:
        return None
    named = ", ".join(f"{op} (operand {o})" if o >= 0 else f"{op} (a split dim it slices or pads)"
                      for op, o in reads[:6]) + (f" and {len(reads) - 6} more"
                                                  if len(reads) > 6 else "")
    return ("warning: apply will refuse this plan: inside a pipeline stage XLA may make these "
            f"reads' layout changes with a collective-permute, which would hang the step: "
            f"{named}. Read those values in the layout their producer writes (or keep the dim "
            "whole), or let `soapjax plan` search: it keeps no such plan (docs/checks.md, "
            "\"Collective-permutes inside a stage\")")


def _plan_header(args: argparse.Namespace, w, g, topo, info: dict, cost_source: str,
                 total_s: float) -> list[str]:
    """The report's opening lines: model, cluster, costs, and how the search went."""
    costs = {"analytic": "analytic (roofline of the topology's device specs; its devices "
                         "are not attached)", "measured": "measured on the local backend"}
    config = f"{w.config}, " if w.config else ""
    searched, proposals = info["search_time_s"], info["proposals"]
    return [
        f"soapjax plan: {w.name} ({config}batch {w.batch_size}) on {topo.name} "
        f"({topo.num_devices} x {topo.device.kind}, mesh "
        + ", ".join(f"{a}={n}" for a, n in zip(topo.axis_names, topo.axis_sizes)) + ")",
        f"costs: {costs.get(cost_source, cost_source)}{_cost_counts(info)}; resharding: "
        f"{args.reshard}{_reshard_check(info)}",
        (f"{len(g.operators)} operators; searched {searched:.1f} s, "
         f"{proposals:,} proposals ({proposals / max(searched, 1e-9):,.0f}/s), "
         f"seed {args.seed}; best found from the '{info['best_from']}' start "
         f"(total {total_s:.1f} s)"),
    ]


def _reshard_check(info: dict) -> str:
    """What `find_plan`'s check of the finalists' reshardings found: ``"; 4 of its 4 best plans
    priced again with XLA's reshardings (the plan: 96 transitions, 9 made by replicating
    whole, +7.1%)"``."""
    from soapjax.search import checked_finalist

    checked = info.get("reshardings_checked")
    if not checked:
        return ""
    rows = [dict(r) for r in dict(checked)["finalists"]]
    done = [r for r in rows if r["xla_s"] is not None]
    if not done:
        return "; its finalists' reshardings not checked (meshes too large)"
    chosen = checked_finalist(info) or done[0]
    failed = (f", {chosen['fallbacks']} not compiled: priced by the ideal model"
              if chosen.get("fallbacks") else "")
    return (f"; {len(done)} of its {len(rows)} best plans priced again with XLA's "
            f"reshardings (the plan: "
            f"{chosen['transitions']} transitions, {chosen['replicated_whole']} made by "
            f"replicating whole{failed}, {chosen['xla_s'] / chosen['ideal_s'] - 1:+.1%})")


def _estimated_note(info: dict, out: str | None) -> str | None:
    """The line that says the plan's prediction rests on estimated operator times (the
    search's measuring budget ran out before their shard programs: `CostModel.estimated_in`),
    and how to measure them; None where none is."""
    names = list(info.get("estimated_operators") or ())
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    simulate = (f"`soapjax simulate --strategy {out}`" if out else "`soapjax simulate` of the "
                "plan")
    return (f"note: {len(names)} of the plan's operators are priced by estimate, not measured "
            f"(the measuring budget ran out: {shown}); {simulate} measures them and may "
            "predict another step time; a larger --budget, or `soapjax profile` first, "
            "measures them during the search")


def _cost_counts(info: dict) -> str:
    """How the measured shard programs were priced: ``" (12 measured now, 30 from the
    cache, 5 estimated after the measuring budget, 0 by fallback)"``."""
    stats = dict(info.get("cost_stats") or ())  # a plan's search info is frozen: pairs
    if not stats or not any(stats.get(k) for k in ("measured", "disk_hits", "estimated",
                                                    "fallbacks")):
        return ""
    return (f" ({stats['measured']} shard programs measured now, {stats['disk_hits']} from "
            f"the cache, {stats.get('estimated', 0)} estimated after the measuring budget, "
            f"{stats['fallbacks']} priced by fallback)")


def _baseline_results(g, topo, w, cm, resharder, info) -> dict:
    from soapjax.simulate.front import compare
    from soapjax.strategy.baselines import baselines

    return compare(g, topo, baselines(g, topo, w.family), cost_model=cm, resharder=resharder,
                   opt_state_factor=info["opt_state_factor"])


# --- check --------------------------------------------------------------------------------------


def _add_export(sub: argparse._SubParsersAction) -> None:
    from soapjax.apply.export import FORMATS

    p = sub.add_parser(
        "export",
        help="write a plan's parameter and batch shardings for your own jax.jit loop",
        description="Write a plan's shardings in the form a plain jax.jit training loop takes: "
        "'specs', Python a script can run or import (MESH_AXES, and PARAM_SPECS and "
        "BATCH_SPECS: a PartitionSpec per leaf keyed by its jax.tree_util.keystr path, with "
        "the line that lays them over your pytrees); 'json', the same as JSON (paths to "
        "per-dim mesh axes, with the mesh). What jax.jit alone cannot "
        "carry (the activations' layouts, recomputation, microbatches, the ring) is listed as "
        "'not expressed', one line each; a pipelined plan is refused. Flax linen's "
        "logical-axis rules are soapjax.apply.export.logical_axis_rules (they need your model's "
        "logical names). The model is rebuilt from the plan, as `soapjax check` does.",
    )
    p.add_argument("--plan", required=True, help="a plan file from `soapjax plan`")
    p.add_argument("--format", required=True, choices=FORMATS[:2],
                   help="specs (Python text) or json")
    p.add_argument("--out", default=None, help="file to write (default: print)")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    import soapjax_zoo as zoo
    from soapjax.apply.export import export_json, partition_specs
    from soapjax.strategy.plan import Plan

    plan = Plan.load(args.plan)
    w = zoo.for_plan(plan)
    graph = _trace(w, name=plan.model)
    if args.format == "json":
        text = export_json(graph, plan, w.optimizer)
    else:
        text = _specs_text(partition_specs(graph, plan, optimizer=w.optimizer), args.plan)
    if args.out is None:
        print(text)
    else:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}")
    return 0


def _specs_text(exported, plan_path: str) -> str:
    """`soapjax export --format specs`: the plan's specs as Python a training script can
    paste or import: the mesh's axes, and per parameter and batch leaf its `PartitionSpec`
    keyed by the leaf's path (``jax.tree_util.keystr``), with how to lay them over a
    pytree; what the specs do not carry as comments."""
    def table(name: str, specs: dict) -> list[str]:
        return [f"{name} = {{"] + [f"    {path!r}: {spec!r}," for path, spec in specs.items()] \
            + ["}"]

    mesh = dict(zip(exported.mesh.axis_names, exported.mesh.axis_sizes))
    lines = [f"# soapjax export --plan {plan_path}: a PartitionSpec per parameter and batch "
             "leaf, keyed by the leaf's path",
             "# (jax.tree_util.keystr); over your pytrees:",
             "#   specs = jax.tree_util.tree_map_with_path(",
             "#       lambda path, _: PARAM_SPECS[jax.tree_util.keystr(path)], params)",
             "from jax.sharding import PartitionSpec as P", "",
             f"MESH_AXES = {mesh!r}", ""]
    lines += table("PARAM_SPECS", exported.params) + [""] + table("BATCH_SPECS", exported.batch)
    lines += ["", "# not expressed:"] + [f"#   {line}" for line in exported.not_expressed]
    return "\n".join(lines)


def _add_check(sub: argparse._SubParsersAction) -> None:
    from soapjax.check import BYTES_TOLERANCE, NUMBERS_TOLERANCE
    from soapjax.cost.reshard import DEFAULT_MODE

    p = sub.add_parser(
        "check",
        help="apply a plan on the attached devices; compare with the unsharded step and the "
        "simulator",
        description="Apply a plan on the attached devices (its topology must match them, e.g. "
        "cpu8 with XLA_FLAGS=--xla_force_host_platform_device_count=8), check that the sharded "
        "step computes the same loss and gradients as the unsharded one (each gradient leaf "
        "against its own scale, so a gradient scaled by a constant fails even where one Adam "
        "step would hide it; the worst leaf and the operator that reads it are named), and the "
        "same parameters and optimizer state after one step, and compare the collectives XLA "
        "compiled (kind, count, bytes) and the measured step time with what the simulator "
        "predicted. The model is rebuilt from the plan: a zoo model by name, user code from "
        "the --model text the plan records. Ends with a verdict: PASS (exit 0) when every "
        "gradient leaf is within --gradient-tolerance, the step within --tolerance and the "
        "predicted collective bytes XLA's within --bytes-tolerance, else FAIL (exit 1), each "
        "bar's line saying by how much.",
    )
    p.add_argument("--plan", required=True, help="a plan file from `soapjax plan`")
    p.add_argument("--mesh", default=None, help="the topology the plan was made on, where the "
                   "plan cannot find it itself (default: the file it was read from, or the "
                   "shipped topology of its name)")
    p.add_argument("--repeats", type=_COUNT, default=5, help="timed runs (default: %(default)s)")
    p.add_argument("--costs", default="auto", choices=("auto", "measured", "analytic"))
    p.add_argument("--reshard", default=None, choices=("ideal", "xla"),
                   help="resharding collectives the prediction prices (default: the plan's own: "
                   "xla where `soapjax plan` priced its reshardings with what XLA compiles, "
                   f"else its search's, {DEFAULT_MODE} by default)")
    p.add_argument("--tolerance", type=_number(float, 0.0, "a number >= 0"),
                   default=NUMBERS_TOLERANCE, help="the largest difference from the unsharded "
                   "step (loss, parameters, optimizer state) that passes (default: %(default)s)")
    p.add_argument("--gradient-tolerance", type=_number(float, 0.0, "a number >= 0"),
                   default=None, help="the largest error of a gradient leaf, relative to that "
                   "leaf's own scale, that passes (default: by the narrowest float type the "
                   "model computes in: 1e-9 float64, 1e-3 float32, 4e-2 bfloat16)")
    p.add_argument("--bytes-tolerance", type=_number(float, 0.0, "a number >= 0"),
                   default=BYTES_TOLERANCE, help="how far predicted collective bytes may be "
                   "from XLA's, relative, and pass (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=_cmd_check)


def _cmd_check(args: argparse.Namespace) -> int:
    import soapjax_zoo as zoo
    from soapjax.check import compare_on_devices
    from soapjax.strategy.plan import Plan
    from soapjax.topology.cluster import load_topology

    plan = Plan.load(args.plan)
    topology = load_topology(args.mesh) if args.mesh is not None else None
    result = compare_on_devices(plan, zoo.for_plan(plan), repeats=args.repeats,
                                costs=args.costs, reshard=args.reshard, topology=topology)
    bars = {"tolerance": args.tolerance, "bytes_tolerance": args.bytes_tolerance,
            "gradient_tolerance": args.gradient_tolerance}
    passed, lines = result.verdict(**bars)
    if args.json:
        _print_json(result.to_json() | {"verdict": "PASS" if passed else "FAIL",
                                        "bars": lines})
    else:
        print(result.table(**bars))
    return 0 if passed else CHECK_FAILED


# --- entry point --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="soapjax",
        description="Find a fast way to shard a JAX/Flax training step over a device mesh "
        "(FlexFlow's SOAP search on named mesh axes), and apply it with jax.jit.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_models, _add_graph, _add_meshes, _add_mesh, _add_calibrate, _add_profile,
                _add_plan, _add_check, _add_simulate, _add_export):
        add(sub)
    return parser


# `soapjax check`'s exit status when the plan misses a bar (2 is for bad input).
CHECK_FAILED = 1
# The exit status after Ctrl-C: 128 + SIGINT, as a shell reports a command SIGINT ended.
INTERRUPTED = 130
# The exit status when whoever reads the output stops (`soapjax models | head`): 128 + SIGPIPE,
# as a shell reports a command SIGPIPE ended; nothing is printed.
BROKEN_PIPE = 141


def _quiet_stdout() -> None:
    """Points stdout at /dev/null, so that Python's flush at exit finds no broken pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


@contextlib.contextmanager
def _warnings_as_lines(command: str) -> Iterator[None]:
    """soapjax's own warnings printed as the command's lines (``soapjax plan: warning: ...``),
    not as Python shows a warning (the file, line and source of a call inside soapjax, which
    say nothing to whoever typed the command); other packages' warnings as Python shows them.
    The format only (`warnings.formatwarning`): where warnings are recorded (pytest's
    ``warns``), they still are."""
    formatted = warnings.formatwarning
    home = os.path.dirname(os.path.abspath(__file__)) + os.sep

    def format_warning(message, category, filename, lineno, line=None):
        if issubclass(category, UserWarning) and os.path.abspath(filename).startswith(home):
            return f"soapjax {command}: warning: {message}\n"
        return formatted(message, category, filename, lineno, line)

    warnings.formatwarning = format_warning
    try:
        yield
    finally:
        warnings.formatwarning = formatted


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status: 0, 2 for a usage error or bad input (one
    line on stderr), 130 (`INTERRUPTED`) after Ctrl-C."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed the usage error (or --help)
        return e.code if isinstance(e.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with _ctrl_c_kept(), _warnings_as_lines(args.command):
            code = args.func(args)
            if args.command != "plan":  # plan checked before it wrote the plan, not after
                _interruptible(None)("")  # one swallowed at the end (a callback's) counts
            return code
    except SoapjaxError as e:
        print(f"soapjax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader stopped reading (`soapjax models | head`): not an error
        _quiet_stdout()
        return BROKEN_PIPE
    except OSError as e:  # a file the command was told to write (--out, --trace) or read
        print(f"soapjax {args.command}: error: {e.strerror or e}"
              + (f": {e.filename}" if e.filename else "")
              + "; expected a path the command can read or write: check it and its "
              "directory's permissions", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        written = "; no plan written" if args.command == "plan" else ""
        print(f"\nsoapjax {args.command}: interrupted{written}", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

"""The `soapjax` command line: a thin layer over the public API, with no logic of its own.

Each subcommand has an `_add_<name>(subparsers)` that declares its arguments and a handler
`_cmd_<name>(args) -> int`. Run `soapjax --help` or `soapjax COMMAND --help`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from soapjax.errors import SoapjaxError

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


# --- models -------------------------------------------------------------------------------------


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list the model zoo with parameter counts and FLOPs per step",
        description="List every registered model with its configs, parameter count and FLOPs "
        "per training step (forward, backward and optimizer update, as XLA counts them).",
    )
    p.add_argument("--config", default="default", help="which config to summarise (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_models)


def _cmd_models(args: argparse.Namespace) -> int:
    import models

    rows = []
    for name in models.names():
        s = models.summarize(models.get(name, args.config))
        rows.append(
            {
                "name": name,
                "config": args.config,
                "configs": list(models.configs(name)),
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
        description="Trace a zoo model's loss to a jaxpr and print its operator graph: one row "
        "per operator with its anchor primitive, output shape with dim roles (S sample, A "
        "attribute, P parameter, - not divisible), splittable reduction dims (R), forward "
        "FLOPs and parameter bytes.",
    )
    p.add_argument("--model", default="gpt2", help="registry name (see `soapjax models`)")
    p.add_argument("--config", default="default", help="model config, e.g. default or tiny")
    p.add_argument("--api", default="linen", choices=("linen", "nnx"), help="Flax API of the model")
    p.add_argument("--json", action="store_true", help="print the graph as JSON")
    p.set_defaults(func=_cmd_graph)


def _cmd_graph(args: argparse.Namespace) -> int:
    import models
    from soapjax import graph

    w = models.get(args.model, args.config, api=args.api)
    g = graph.trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
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
        description="List the topologies in meshes/: name, devices, mesh axes, device kind.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_meshes)


def _cmd_meshes(args: argparse.Namespace) -> int:
    from soapjax import topology

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
    print(f"{'name':<14}{'platform':<10}{'devices':>8}  {'axes':<22}device")
    for r in rows:
        axes = ", ".join(f"{a}={n}" for a, n in r["axes"].items())
        print(
            f"{r['name']:<14}{r['platform']:<10}{r['num_devices']:>8}  {axes:<22}{r['device_kind']}"
        )
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
    from soapjax import topology

    s = topology.load_topology(args.name).summary()
    if args.json:
        _print_json(s)
        return 0
    d = s["device"]
    flops = ", ".join(f"{k} {v:g}" for k, v in d["peak_tflops"].items())
    print(f"{s['name']}: {s['description']}")
    print(
        f"  {s['num_devices']} {s['platform']} devices = {s['num_nodes']} nodes x "
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
    for add in (_add_models, _add_graph, _add_meshes, _add_mesh):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except SoapjaxError as e:
        print(f"soapjax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

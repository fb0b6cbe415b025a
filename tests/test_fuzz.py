"""Fuzzing what soapjax reads from disk: plan files, topology files, cache entries.

Deterministic (seeded) truncations, mistyped values and dropped keys of real files, and plan
files with operators renamed, reordered, added or dropped (configs bind by name). A plan or
topology file either still reads, or fails with the SoapjaxError of its kind (on the command
line: exit status 2 and a message); never another exception. A corrupt cache entry is a miss,
with a warning, and never an exception. Runs in a few seconds.
"""

import copy
import json
import logging
import random
import re

import pytest

import soapjax_zoo as zoo
from soapjax import cli, training
from soapjax.base.errors import PlanError, TopologyError
from soapjax.cost.reshard import Resharder, _normalise
from soapjax.graph.opgraph import trace
from soapjax.measure import _timing
from soapjax.simulate.front import parse_strategy
from soapjax.strategy import space
from soapjax.strategy.plan import Plan
from soapjax.topology.cluster import MESHES_DIR, load_topology

MESHES = sorted(MESHES_DIR.glob("*.toml"))
ODD_VALUES = [None, 0, -1, 2.5, 1e308, True, "x", "", [], {}, [[1]], ["model", "model"],
              {"a": None}, [["data"], 3]]
ODD_TOML = ['"x"', "-1", "0", "[]", "{}", "true", "1e999", "nan", '"-3 GB/s"', '"12 parsecs"',
            '[["device:0"]]', '"device:99"', '{ gpu = 0 }', '{ data = 3, model = 3 }']


def _paths(node, path=()):
    """Every (path, value) inside a JSON value."""
    yield path, node
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, path + (k,))


def _set(data, path, value):
    for k in path[:-1]:
        data = data[k]
    if value is _DROP:
        del data[path[-1]]
    else:
        data[path[-1]] = value


_DROP = object()


def mutated_json(data: dict, rng: random.Random, n: int):
    """(description, text): truncations, a value made another type, a key dropped."""
    text = json.dumps(data, indent=1)
    for k in range(n):
        kind = k % 3
        if kind == 0:
            cut = rng.randrange(len(text))
            yield f"truncated at {cut}", text[:cut]
            continue
        paths = [p for p, _ in _paths(data) if p]
        path = rng.choice(paths)
        value = _DROP if kind == 2 else copy.deepcopy(rng.choice(ODD_VALUES))
        mutated = copy.deepcopy(data)
        _set(mutated, path, value)
        yield f"{'dropped' if value is _DROP else f'set to {value!r}'} at {list(path)}", \
            json.dumps(mutated)


@pytest.fixture(scope="module")
def mlp():
    w = zoo.get("mlp", "tiny")
    return w, trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="mlp")


def test_plan_files(mlp, tmp_path, capsys):
    w, graph = mlp
    topo = load_topology("cpu8")
    mesh = space.MeshShape.of(topo)
    strategy = space.Strategy(space.data_parallel(graph, mesh).configs, ("data",))
    plan = Plan.make(graph, topo, strategy, model_config="tiny", predicted={"step_time_s": 1e-3},
                     baselines={"data-parallel": 1e-3}, search={"seed": 0})
    rng = random.Random(0)
    path = tmp_path / "plan.json"
    outcomes = {"read": 0, "refused": 0}
    for k, (what, text) in enumerate(mutated_json(plan.to_json(), rng, 240)):
        path.write_text(text)
        try:
            Plan.load(path)
            parse_strategy(graph, topo, str(path))
            outcomes["read"] += 1
        except PlanError as e:
            assert str(e), what
            outcomes["refused"] += 1
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"plan file {what}: {type(e).__name__}: {e}")
        if k % 40 == 0:  # the command line says the same in one line, exit status 2
            code = cli.main(["simulate", "--model", "mlp", "--config", "tiny", "--costs",
                             "analytic", "--json", "--strategy", str(path)])
            _, err = capsys.readouterr()
            assert code in (0, 2) and "Traceback" not in err, (what, err)
            assert code == 0 or err.startswith("soapjax simulate: error: "), (what, err)
    assert outcomes["refused"] > 100 and outcomes["read"] > 10, outcomes


def mutated_toml(text: str, rng: random.Random, n: int):
    lines = text.splitlines()
    values = [i for i, line in enumerate(lines) if re.match(r"\s*[\w.]+\s*=", line)]
    for k in range(n):
        kind = k % 3
        if kind == 0:
            cut = rng.randrange(len(text))
            yield f"truncated at {cut}", text[:cut]
        elif kind == 1:
            i = rng.choice(values)
            odd = rng.choice(ODD_TOML)
            key = lines[i].split("=", 1)[0]
            yield f"line {i + 1} set to {odd}", "\n".join(
                lines[:i] + [f"{key}= {odd}"] + lines[i + 1:])
        else:
            i = rng.choice(values)
            yield f"line {i + 1} dropped", "\n".join(lines[:i] + lines[i + 1:])


def test_topology_files(tmp_path, capsys):
    rng = random.Random(1)
    outcomes = {"read": 0, "refused": 0}
    for source in MESHES:
        path = tmp_path / source.name
        for k, (what, text) in enumerate(mutated_toml(source.read_text(), rng, 45)):
            path.write_text(text)
            try:
                load_topology(path)
                outcomes["read"] += 1
            except TopologyError as e:
                assert str(e).startswith(str(path)), (source.name, what, e)
                outcomes["refused"] += 1
            except Exception as e:  # noqa: BLE001
                pytest.fail(f"{source.name} {what}: {type(e).__name__}: {e}")
            if k % 15 == 0:
                code = cli.main(["mesh", "show", str(path)])
                out, err = capsys.readouterr()
                assert code in (0, 2) and "Traceback" not in err, (source.name, what, err)
    assert outcomes["refused"] > 150 and outcomes["read"] > 20, outcomes


def test_cost_cache_entries(tmp_path, caplog):
    cache = _timing.DiskCache(tmp_path, {"schema": 1, "backend": "cpu", "device_kind": "cpu",
                                         "jax": "0", "jaxlib": "0"})
    t = _timing.Timing(1e-4, 0.01, 100, 5, 2e-6)
    sig = _timing.signature("operator", "a program")
    cache.store(sig, cache.entry(sig, "operator", "fc1 [2, 4]", t, t))
    good = json.loads(cache.path(sig).read_text())
    rng = random.Random(2)
    for what, text in mutated_json(good, rng, 150):
        cache.path(sig).write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            entry = cache.load(sig)
        if entry is None:
            assert "cost cache entry" in caplog.text and "measuring again" in caplog.text, what
        else:  # what the cost model reads of it
            back = entry["backward"]
            assert entry["forward"]["seconds"] >= 0 and (back is None or back["seconds"] >= 0)


def test_reshard_cache_entries(tmp_path, caplog):
    resharder = Resharder(space.MeshShape(("data", "model"), (2, 4)), "xla", cache_dir=tmp_path)
    key = _normalise((64, 1024), "float32", (("data",), ()), ((), ("model",)), (),
                     resharder.mesh)
    resharder._write_cache(key, [["all_gather", 262144.0, [0], 0]])  # as a compile leaves it
    path = resharder._cache_path(resharder._cache_key(key))
    good = json.loads(path.read_text())
    rng = random.Random(3)
    misses = 0
    for what, text in mutated_json(good, rng, 150):
        path.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            got = resharder._read_cache(key)  # what a lookup does before compiling
        if got is None:
            misses += 1
        else:
            assert all(c.nbytes >= 0 and set(c.axes) <= {"data", "model"} for c in got), what
    assert misses > 50


def test_plan_cache_entries(mlp, tmp_path, capsys):
    w, graph = mlp
    topo = load_topology("cpu8")
    plan = Plan.make(graph, topo, space.data_parallel(graph, space.MeshShape.of(topo)),
                     predicted={"step_time_s": 1e-3})
    options = training.PlanOptions(None, "analytic", w.optimizer)
    key = training._cache_key(graph, topo, training.SearchSettings(), options)
    path = tmp_path / "plans" / "mlp.json"
    training._write_cached(path, key, plan)
    good = json.loads(path.read_text())
    rng = random.Random(4)
    for what, text in mutated_json(good, rng, 120):
        path.write_text(text)
        got = training._read_cached(path, key)
        err = capsys.readouterr().err
        assert got is None or isinstance(got, Plan), what
        if got is None and "key" in text and text.endswith("}"):
            pass  # a changed key is a miss, not a corrupt file
        elif got is None:
            assert "soapjax: warning: ignoring the unreadable cached plan" in err, (what, err)


def edited_operators(data: dict, rng: random.Random, n: int):
    """(kind, plan JSON) with the operators renamed, reordered, added or dropped at random."""
    for k in range(n):
        kind = ("reorder", "rename", "extra", "missing")[k % 4]
        edited = copy.deepcopy(data)
        items = list(edited["operators"].items())
        i = rng.randrange(len(items))
        name, entry = items[i]
        if kind == "reorder":
            rng.shuffle(items)
        elif kind == "rename":
            j = rng.randrange(len(name))
            items[i] = (name[:j] + rng.choice("xyz_/0") + name[j + 1:], entry)
        elif kind == "extra":
            items.insert(rng.randrange(len(items) + 1), (name + rng.choice(["_2", "x", "/b"]),
                                                         copy.deepcopy(entry)))
        else:
            del items[i]
        edited["operators"] = dict(items)
        yield kind, edited


def test_plan_files_bind_configs_by_operator_name(mlp, tmp_path, capsys):
    """Configs go to operators by name: any order reads as the same strategy; a renamed, extra
    or missing operator is a PlanError (exit status 2 on the command line), never a config
    applied to another operator."""
    _, graph = mlp
    topo = load_topology("cpu8")
    mesh = space.MeshShape.of(topo)
    configs = list(space.data_parallel(graph, mesh).configs)
    configs[0] = space.Config((("data",), ("model",), ()))  # fc1 unlike the others
    strategy = space.Strategy(tuple(configs), recompute=("selective", "none", "none", "full"))
    data = Plan.make(graph, topo, strategy, model_config="tiny").to_json()
    rng = random.Random(5)
    path = tmp_path / "plan.json"
    seen = {"reorder": 0, "rename": 0, "extra": 0, "missing": 0}
    for k, (kind, edited) in enumerate(edited_operators(data, rng, 80)):
        path.write_text(json.dumps(edited))
        renamed_to_itself = kind == "rename" and set(edited["operators"]) == set(
            data["operators"])
        if kind == "reorder" or renamed_to_itself:
            assert parse_strategy(graph, topo, str(path)) == strategy, kind
        else:
            with pytest.raises(PlanError,
                               match="the plan has (a config for operator|no config for)"):
                parse_strategy(graph, topo, str(path))
            seen[kind] += 1
        if k % 10 == 0:
            code = cli.main(["simulate", "--model", "mlp", "--size", "tiny", "--costs",
                             "analytic", "--json", "--strategy", str(path)])
            err = capsys.readouterr().err
            assert code == (0 if kind == "reorder" or renamed_to_itself else 2), (kind, err)
            assert code == 0 or (err.startswith("soapjax simulate: error: ")
                                 and err.count("\n") == 1), err
    assert min(seen[k] for k in ("rename", "extra", "missing")) >= 15, seen

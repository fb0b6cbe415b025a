"""The architecture, enforced: imports flow one way through the pipeline's stages.

`STAGES` is the one written order of soapjax's modules, lowest first (docs/architecture.md
walks it module by module). A module may import modules of its own stage or earlier ones,
never a later one, not even inside a function; only the command line imports inside functions
(to start fast). Two packages sit above the library and are never imported by it: the zoo
(`soapjax_zoo`; only the command line may load models from it) and the evaluation
(`soapjax_eval`; nothing in the library may).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "soapjax"

STAGES: tuple[tuple[str, ...], ...] = (
    ("errors", "_cache", "_dtypes", "collectives"),  # no soapjax imports: shared leaves
    ("_dims", "_ir", "_program", "_grouping", "graph", "_local", "_inner"),  # jaxpr -> OpGraph
    ("_topology_file", "_routing", "topology"),  # meshes/*.toml -> Topology
    ("space", "memory", "pipeline", "_arguments"),  # OpGraph x mesh -> configs, strategies;
    # recompute, microbatches, pipeline stages and their schedules; the planners' argument checks
    ("baselines", "plan", "_strategy_file"),  # expert strategies; the Plan file; --strategy
    ("_hlo_text", "_timing", "devices", "links", "devicefit", "roofline", "updates", "flops",
     "cost", "_hlo_flops", "hlo", "_reshard_ideal", "_reshard_worker", "reshard"),  # prices
    ("_taskgraph", "_simresult", "_flatsim", "pipesim", "simulate"),  # strategy -> timeline
    ("search",),  # MCMC -> best plan
    ("_validation", "_shardings", "_pipelined", "apply"),  # plan -> sharded, jitted step
    ("training", "check"),  # the training helper; a plan against the devices
    ("report", "plot"),  # text, HTML and pictures
    ("cli", "__init__"),  # the command line; the public surface
)
STAGE = {name: i for i, names in enumerate(STAGES) for name in names}

# Function-local soapjax imports still to move, each with why it is not fixed here.
KNOWN_LOCAL: dict[tuple[str, str], str] = {}


def _modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py"))


def _imports(name: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import in soapjax/<name>.py."""
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    out = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, local) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                if child.module == "soapjax":  # from soapjax import x, y
                    out.extend((f"soapjax.{a.name}", child.lineno, local) for a in child.names)
                else:
                    out.append((child.module, child.lineno, local))
            visit(child, inner)

    visit(tree, False)
    return out


def test_every_module_has_a_stage():
    missing = [m for m in _modules() if m not in STAGE]
    assert not missing, f"add {missing} to STAGES (and docs/architecture.md)"
    gone = [m for m in STAGE if m not in _modules()]
    assert not gone, f"STAGES names modules that no longer exist: {gone}"


@pytest.mark.parametrize("name", _modules())
def test_imports_flow_one_way(name):
    bad = []
    for module, line, local in _imports(name):
        top = module.split(".")[0]
        if top == "soapjax_zoo" and name != "cli":
            bad.append(f"line {line}: imports the zoo ({module}); only the CLI may")
        if top == "soapjax_eval":
            bad.append(f"line {line}: imports the evaluation ({module}), which sits above the "
                       "library")
        if not module.startswith("soapjax."):
            continue
        target = module.split(".")[1]
        if STAGE[target] > STAGE[name]:
            bad.append(f"line {line}: imports {target} (stage {STAGE[target]}), a later stage "
                       f"than {name} (stage {STAGE[name]})")
        if local and name != "cli" and (name, target) not in KNOWN_LOCAL:
            bad.append(f"line {line}: imports {target} inside a function; move the code to "
                       f"the module it belongs to, or import at the top")
    assert not bad, f"soapjax/{name}.py:\n  " + "\n  ".join(bad)


def test_known_local_imports_are_still_there():
    # Once fixed, an entry must leave KNOWN_LOCAL, so the list cannot go stale.
    for name, target in KNOWN_LOCAL:
        assert any(m == f"soapjax.{target}" and local for m, _, local in _imports(name)), (
            f"{name} no longer imports {target} inside a function: drop it from KNOWN_LOCAL")


def test_the_architecture_doc_walks_every_module_in_stage_order():
    text = (ROOT / "docs" / "architecture.md").read_text()
    order = re.findall(r"^- `soapjax/(\w+)\.py`", text, re.MULTILINE)
    assert sorted(order) == _modules(), "docs/architecture.md: one line per module"
    stages = [STAGE[m] for m in order]
    assert stages == sorted(stages), "docs/architecture.md lists modules out of stage order"


def test_every_module_has_a_test_file():
    covered = {p.stem.removeprefix("test_") for p in (ROOT / "tests").glob("test_*.py")}
    # Private helpers are tested through their public module.
    owner = {"_cache": "cost", "_dtypes": "cost", "_dims": "graph", "_ir": "graph",
             "_program": "graph", "_grouping": "graph", "_local": "local",
             "_topology_file": "topology", "_routing": "topology", "collectives": "topology",
             "_timing": "cost", "_reshard_ideal": "reshard", "_reshard_worker": "reshard",
             "_taskgraph": "simulate", "_simresult": "simulate", "_strategy_file": "simulate",
                 "_flatsim": "simulate",
             "_validation": "apply", "_shardings": "apply", "_hlo_text": "hlo", "_hlo_flops": "hlo",
             "errors": "cli", "__init__": "notebook"}
    missing = [m for m in _modules() if owner.get(m, m) not in covered]
    assert not missing, f"no tests/test_<module>.py for {missing}"


# The fixed choices, each spelled in one table (docs/architecture.md, "Adding a schedule, a
# collective kind, a baseline"): its names, and the modules that may list two or more of them.
FIXED_CHOICES = {
    "recompute policies": ({"none", "selective", "full"}, {"space"}),
    "pipeline schedules": ({"gpipe", "1f1b", "interleaved"}, {"pipeline"}),
    "collective kinds": ({"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                          "collective_permute", "point_to_point"},
                         {"collectives", "links"}),  # links: a measuring program per kind
    "collective opcodes": ({"all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                            "collective-permute"}, {"collectives"}),
    "baselines": ({"data-parallel", "megatron", "fsdp", "megatron-sp", "fsdp-recompute",
                   "expert-cnn", "expert-rnn"}, {"baselines"}),
}


@pytest.mark.parametrize("choice", FIXED_CHOICES)
def test_fixed_choices_have_one_table(choice):
    """No module but the owner lists the names of a fixed choice (a tuple, list, set or dict of
    two or more of them): the others read the owner's table."""
    names, owners = FIXED_CHOICES[choice]
    bad = []
    for module in _modules():
        for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                found = {e.value for e in items if isinstance(e, ast.Constant)} & names
                if len(found) >= 2 and module not in owners:
                    bad.append(f"soapjax/{module}.py:{node.lineno} lists {sorted(found)}")
    assert not bad, f"{choice} spelled outside {sorted(owners)}:\n  " + "\n  ".join(bad)


# The modules that may ask whether a strategy is pipelined: the simulator's and apply's.
PIPELINE_AWARE = {"_flatsim", "pipesim", "simulate",  # the simulator
                  "_validation", "_shardings", "_pipelined", "apply"}  # apply


def test_only_the_simulator_and_apply_branch_on_pipeline_stages():
    """'Is it pipelined?' is decided inside the simulator (`soapjax.simulate.simulate`,
    `open_simulation`) and inside apply (`soapjax.apply.sharded_train_step`); the search, the
    command line, the training helper and the checks call those and never ask."""
    asking = {}
    for name in _modules():
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        lines = [n.lineno for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and n.attr == "pipelined"]
        if lines and name not in PIPELINE_AWARE:
            asking[name] = lines
    assert not asking, f"modules outside the simulator and apply read .pipelined: {asking}"

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
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "soapjax"

STAGES: tuple[tuple[str, ...], ...] = (
    ("errors", "_cache", "_dtypes", "collectives", "attention"),  # no soapjax imports: leaves
    ("_dims", "_ir", "_program", "_grouping", "graph", "_local", "_inner"),  # jaxpr -> OpGraph
    ("_topology_file", "_routing", "topology"),  # meshes/*.toml -> Topology
    ("space", "memory", "pipeline", "_arguments"),  # OpGraph x mesh -> configs, strategies;
    # recompute, microbatches, pipeline stages and their schedules; the planners' argument checks
    ("baselines", "plan", "_strategy_file"),  # expert strategies; the Plan file; --strategy
    ("_hlo_text", "_timing", "devices", "links", "devicefit", "stepprofile", "roofline",
     "kernels", "updates",
     "flops", "cost", "_hlo_flops", "hlo", "_reshard_ideal", "_reshard_worker",
     "reshard"),  # prices
    ("_taskgraph", "_simresult", "_flatsim", "pipesim", "simulate"),  # strategy -> timeline
    ("_chain", "search"),  # MCMC -> best plan
    ("_pipeline_layout", "_validation", "_context_parallel", "_manual", "_flatstep",
     "_pipelined", "_shardings", "apply"),  # plan -> sharded, jitted step
    ("exactness", "training", "check"),  # gradients against the unsharded step; the training
    # helper; a plan against the devices
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
             "_program": "graph", "_grouping": "graph",
             "_topology_file": "topology", "_routing": "topology", "collectives": "topology",
             "_timing": "cost", "_reshard_ideal": "reshard", "_reshard_worker": "reshard",
             "_taskgraph": "simulate", "_simresult": "simulate", "_strategy_file": "simulate",
                 "_flatsim": "simulate", "_chain": "search",
             "_validation": "apply", "_shardings": "apply", "_flatstep": "apply",
             "_context_parallel": "flash_attention", "_manual": "expert_context_parallel",
             "_hlo_text": "hlo", "_hlo_flops": "hlo",
             "errors": "cli", "__init__": "notebook"}
    missing = [m for m in _modules() if owner.get(m, m) not in covered]
    assert not missing, f"no tests/test_<module>.py for {missing}"


def test_test_files_are_named_after_their_module():
    """One rule: soapjax/<module>.py is tested in tests/test_<module>.py, a private module's
    underscore kept (soapjax/_inner.py: tests/test__inner.py); a test file of no one module
    (the zoo, the corpus, the notebook) has a name that is no module's."""
    modules = set(_modules())
    bad = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        name = path.stem.removeprefix("test_")
        if name.startswith("_") and name not in modules:
            bad.append(f"{path.name}: no soapjax/{name}.py")
        elif f"_{name}" in modules:
            bad.append(f"{path.name} tests soapjax/_{name}.py: name it test__{name}.py")
    assert not bad, "\n  ".join(["test files off the naming rule:", *bad])


def _public_modules() -> list[str]:
    return [m for m in _modules() if not m.startswith("_") or m == "__init__"]


@pytest.mark.parametrize("name", _public_modules())
def test_public_modules_say_what_users_import(name):
    """Every public module lists its public names in `__all__`, and each one exists."""
    module = importlib.import_module("soapjax" if name == "__init__" else f"soapjax.{name}")
    names = getattr(module, "__all__", None)
    assert names is not None, f"soapjax/{name}.py has no __all__"
    assert len(set(names)) == len(names), f"soapjax/{name}.py: __all__ repeats a name"
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"soapjax/{name}.py: __all__ names what it does not define: {missing}"
    private = [n for n in names if n.startswith("_")]
    assert not private, f"soapjax/{name}.py: __all__ lists private names: {private}"


_PRIVATE_CLASS = re.compile(r"(?<![\w.])_[A-Z]\w*")


def _private_types_in_public_signatures(name: str) -> list[str]:
    """Where a public class's annotated field or a public function's or method's signature in
    soapjax/<name>.py names a private class (``_Program``)."""
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    out = []

    def check(node: ast.AST | None, where: str, line: int) -> None:
        if node is not None and (found := _PRIVATE_CLASS.findall(ast.unparse(node))):
            out.append(f"line {line}: {where} is typed with {sorted(set(found))}")

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name.startswith("_") and not node.name.startswith("__"):
                    continue
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                    if arg is not None:
                        check(arg.annotation, f"{prefix}{node.name}({arg.arg})", node.lineno)
                check(node.returns, f"{prefix}{node.name}() ->", node.lineno)
            elif isinstance(node, ast.AnnAssign) and prefix:
                check(node.annotation, f"{prefix}{ast.unparse(node.target)}", node.lineno)

    visit(tree.body, "")
    return out


@pytest.mark.parametrize("name", _public_modules())
def test_no_public_field_or_signature_is_typed_with_a_private_class(name):
    """A user reads a public class's fields and a public function's signature: the types they
    name are public too (`OpGraph.program` is a `Program`, not a `_Program`)."""
    bad = _private_types_in_public_signatures(name)
    assert not bad, f"soapjax/{name}.py:\n  " + "\n  ".join(bad)


def test_no_module_patches_a_class_on_import():
    """Importing a module changes no class (`report.register_html_reprs` is called, by
    ``import soapjax``, to give classes their notebook HTML)."""
    bad = []
    for name in _modules():
        for node in ast.parse((PACKAGE / f"{name}.py").read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            bad += [f"soapjax/{name}.py:{node.lineno} sets {ast.unparse(t)}"
                    for t in targets if isinstance(t, ast.Attribute)]
    assert not bad, "\n  ".join(["assignments to attributes at import:", *bad])


def _private_uses(path: Path) -> list[str]:
    """Imports of private soapjax modules or names, and private attributes of imported soapjax
    modules, in a script or an evaluation module."""
    tree = ast.parse(path.read_text())
    bound = set()  # local names bound to soapjax modules or their names
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "soapjax":
                    if any(part.startswith("_") for part in a.name.split(".")):
                        bad.append(f"line {node.lineno}: import {a.name}")
                    bound.add(a.asname or "soapjax")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts = node.module.split(".")
            if parts[0] != "soapjax":
                continue
            if any(part.startswith("_") for part in parts):
                bad.append(f"line {node.lineno}: from {node.module} import ...")
            for a in node.names:
                if a.name.startswith("_"):
                    bad.append(f"line {node.lineno}: from {node.module} import {a.name}")
                bound.add(a.asname or a.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    return bad


SCRIPTS = sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("soapjax_eval/*.py")])


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_scripts_and_the_evaluation_use_the_public_api(path):
    """The scripts and `soapjax_eval` import what soapjax's public modules list, as a user
    would; what they need is re-exported there (`soapjax.cost.time_loop`, `hlo.launched_kernels`,
    `cost.cache_root`). `scripts/_decoder_metrics.py` is the scripts' own helper."""
    bad = _private_uses(path)
    assert not bad, f"{path.relative_to(ROOT)} uses soapjax's private names:\n  " + "\n  ".join(bad)


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
                  "_pipeline_layout", "_validation", "_flatstep", "_pipelined", "_shardings",
                  "apply"}  # apply


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


@pytest.mark.heavy
def test_a_plan_enters_no_module_more_than_three_times_through_check():
    """Issue 30's measure of a plan bouncing between modules: `scripts/trace_plan.py` follows
    ``soapjax check`` of GPT-2 tiny's plan and counts, per module, the calls into it from
    another module that carry the plan (a `Plan`, `Strategy` or checked strategy)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "trace_plan.py"), "--max", "3"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]

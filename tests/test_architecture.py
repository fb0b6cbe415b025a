"""The architecture, enforced: imports flow one way through the pipeline's stages.

The stages are soapjax's folders (`soapjax.base`, `soapjax.graph`, ... `soapjax.apply`), each
saying its place in the order as the first words of its ``__init__``'s docstring ("Stage 3,
..."); the modules at the package's root sit above them all, in the order `TOP` gives
(docs/architecture.md walks the folders and their modules). A module may import modules of its
own stage or earlier ones, never a later one, not even inside a function; only the command line
imports inside functions (to start fast). Two packages sit above the library and are never
imported by it: the zoo (`soapjax_zoo`; only the command line may load models from it) and the
evaluation (`soapjax_eval`; nothing in the library may).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from soapjax._moved import MOVED

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "soapjax"

# The root's modules, above every folder, lowest first.
TOP: tuple[tuple[str, ...], ...] = (
    ("_moved", "exactness", "_nnx", "training", "checkpoint", "check"),  # gradients against the
    # unsharded step; the training helper and its checkpoints; a plan against the devices; the
    # old import paths
    ("report", "plot"),  # text, HTML and pictures
    ("cli", "__init__"),  # the command line; the public surface
)


def _folders() -> dict[str, int]:
    """Each stage folder and its place, read from its ``__init__``'s docstring."""
    out = {}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        m = re.match(r"Stage (\d+),", doc)
        assert m, f"{init.relative_to(ROOT)}: its docstring must start 'Stage N, ...'"
        out[init.parent.name] = int(m.group(1))
    return out


FOLDERS = _folders()


def _modules() -> list[str]:
    """Every module, as its path under soapjax/ with dots and no suffix (``strategy.space``,
    ``graph.__init__``, ``cli``)."""
    return sorted(".".join(p.relative_to(PACKAGE).with_suffix("").parts)
                  for p in PACKAGE.rglob("*.py"))


def _path(name: str) -> Path:
    return PACKAGE.joinpath(*name.split(".")).with_suffix(".py")


def _base(name: str) -> str:
    """A module's own name (``space`` for ``strategy.space``; a folder's ``__init__`` is the
    folder's name)."""
    parts = name.split(".")
    return parts[0] if parts[-1] == "__init__" and len(parts) > 1 else parts[-1]


def _stage(name: str) -> int:
    """`name`'s place: its folder's, or above every folder for the root's modules."""
    top = name.split(".")[0]
    if top in FOLDERS:
        return FOLDERS[top]
    row = next(k for k, names in enumerate(TOP) if top in names)
    return max(FOLDERS.values()) + 1 + row


def _imports(name: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import in `name`."""
    tree = ast.parse(_path(name).read_text())
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
    loose = [m for m in _modules() if "." not in m
             and not any(m in names for names in TOP)]
    assert not loose, f"add {loose} to TOP, or move them into a stage folder"
    gone = [m for names in TOP for m in names if m not in _modules()]
    assert not gone, f"TOP names modules that no longer exist: {gone}"
    nested = [m for m in _modules() if m.count(".") > 1]
    assert not nested, f"folders inside stage folders: {nested}"


def test_no_module_over_700_lines_without_saying_why():
    """A module past 700 lines says at its top, in its docstring, why it stays one."""
    bad = []
    for name in _modules():
        text = _path(name).read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > 700 and "on purpose" not in doc and "stays one" not in doc:
            bad.append(f"soapjax/{name.replace('.', '/')}.py: {text.count(chr(10))} lines")
    assert not bad, "split these, or say in the docstring why each stays one:\n  " + \
        "\n  ".join(bad)


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
        target = module.removeprefix("soapjax.")
        if target.split(".")[0] in MOVED:
            bad.append(f"line {line}: imports {module}, an old path (soapjax._moved); import "
                       f"soapjax.{MOVED[target.split('.')[0]]}")
            continue
        if _stage(target) > _stage(name):
            bad.append(f"line {line}: imports {target} (stage {_stage(target)}), a later stage "
                       f"than {name} (stage {_stage(name)})")
        if local and name != "cli":
            bad.append(f"line {line}: imports {target} inside a function; move the code to "
                       f"the module it belongs to, or import at the top")
    assert not bad, f"soapjax/{name.replace('.', '/')}.py:\n  " + "\n  ".join(bad)


def test_the_architecture_doc_walks_every_module_in_stage_order():
    text = (ROOT / "docs" / "architecture.md").read_text()
    order = [p.replace("/", ".") for p in
             re.findall(r"^\s*- `soapjax/([\w/]+)\.py`", text, re.MULTILINE)]
    listed = [m for m in _modules() if not m.endswith(".__init__")]
    assert sorted(order) == listed, "docs/architecture.md: one line per module"
    stages = [_stage(m) for m in order]
    assert stages == sorted(stages), "docs/architecture.md lists modules out of stage order"


def test_every_module_has_a_test_file():
    """soapjax/<folder>/<module>.py is tested in tests/test_<module>.py, or, for a private
    helper, through the module named here (or its folder's test file)."""
    covered = {p.stem.removeprefix("test_") for p in (ROOT / "tests").glob("test_*.py")}
    owner = {"_cache": "cost", "_dtypes": "cost", "_dims": "graph", "_ir": "graph",
             "_program": "graph", "_grouping": "graph", "opgraph": "graph",
             "_topology_file": "topology", "_routing": "topology", "cluster": "topology",
             "collectives": "topology", "_timing": "cost", "operators": "cost",
             "_reshard_ideal": "reshard", "_reshard_worker": "reshard",
             "_taskgraph": "simulate", "_simresult": "simulate", "_strategy_file": "simulate",
             "_flatsim": "simulate", "front": "simulate", "_chain": "search", "find": "search",
             "_clock": "search", "grids": "search", "optimality": "search",
             "_flat_memory": "simulate", "_flat_attention": "simulate", "_flat_tasks": "simulate",
             "_flat_proposals": "simulate", "_flat_leaves": "simulate", "_pipe_cut": "pipesim",
             "_stage_groups": "pipesim",
             "_schedule_time": "pipeline",
             "pipelines": "search", "stages": "search",
             "_validation": "apply", "_shardings": "apply", "_flatstep": "apply", "step": "apply",
             "_context_parallel": "flash_attention", "_manual": "expert_context_parallel",
             "_hlo_text": "hlo", "_hlo_flops": "hlo", "_moved": "architecture", "_paths": "cli",
             "errors": "cli", "__init__": "notebook", "_constants": "frozen",
             "_nnx": "training"}
    missing = [m for m in _modules() if not m.endswith(".__init__")
               and owner.get(_base(m), _base(m)) not in covered]
    assert not missing, f"no tests/test_<module>.py for {missing}"


def test_test_files_are_named_after_their_module():
    """One rule: soapjax/<folder>/<module>.py is tested in tests/test_<module>.py, a private
    module's underscore kept (soapjax/graph/_inner.py: tests/test__inner.py); a test file of no
    one module (the zoo, the corpus, the notebook) has a name that is no module's."""
    modules = {_base(m) for m in _modules()}
    bad = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        name = path.stem.removeprefix("test_")
        if name.startswith("_") and name not in modules:
            bad.append(f"{path.name}: no soapjax/.../{name}.py")
        elif f"_{name}" in modules:
            bad.append(f"{path.name} tests a module _{name}.py: name it test__{name}.py")
    assert not bad, "\n  ".join(["test files off the naming rule:", *bad])


def _public_modules() -> list[str]:
    return [m for m in _modules() if not _base(m).startswith("_") or m == "__init__"]


@pytest.mark.parametrize("name", _public_modules())
def test_public_modules_say_what_users_import(name):
    """Every public module lists its public names in `__all__`, and each one exists."""
    module = importlib.import_module(
        "soapjax." + name.removesuffix(".__init__") if name != "__init__" else "soapjax")
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
    tree = ast.parse(_path(name).read_text())
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
        for node in ast.parse(_path(name).read_text()).body:
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
    would; what they need is re-exported there (`soapjax.measure.time_loop`, `hlo.launched_kernels`,
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
                   "expert-cnn", "expert-rnn", "maxtext-moe"}, {"baselines"}),
    "attention implementations": ({"xla", "cudnn"}, {"attention"}),
}


@pytest.mark.parametrize("choice", FIXED_CHOICES)
def test_fixed_choices_have_one_table(choice):
    """No module but the owner lists the names of a fixed choice (a tuple, list, set or dict of
    two or more of them): the others read the owner's table."""
    names, owners = FIXED_CHOICES[choice]
    bad = []
    for module in _modules():
        for node in ast.walk(ast.parse(_path(module).read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                found = {e.value for e in items if isinstance(e, ast.Constant)} & names
                if len(found) >= 2 and _base(module) not in owners:
                    bad.append(f"soapjax/{module}.py:{node.lineno} lists {sorted(found)}")
    assert not bad, f"{choice} spelled outside {sorted(owners)}:\n  " + "\n  ".join(bad)


# The modules that may ask whether a strategy is pipelined: the simulator's and apply's.
PIPELINE_AWARE = {"_flatsim", "_flat_tasks", "pipesim",
                  "front",  # the simulator
                  "_pipeline_layout", "_validation", "_flatstep", "_pipelined", "_shardings",
                  "step", "export"}  # apply


def test_only_the_simulator_and_apply_branch_on_pipeline_stages():
    """'Is it pipelined?' is decided inside the simulator (`soapjax.simulate.simulate`,
    `open_simulation`) and inside apply (`soapjax.apply.sharded_train_step`); the search, the
    command line, the training helper and the checks call those and never ask."""
    asking = {}
    for name in _modules():
        tree = ast.parse(_path(name).read_text())
        lines = [n.lineno for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and n.attr == "pipelined"]
        if lines and _base(name) not in PIPELINE_AWARE:
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


def test_typed_choices_are_their_tables():
    """A choice typed as a `Literal` names exactly its table's rows, so a checker that reads
    the type and the code that reads the table agree."""
    import typing

    from soapjax.base.attention import IMPLEMENTATIONS, AttentionImplementation
    from soapjax.strategy.pipeline import DEFAULT_SCHEDULE, SCHEDULES, ScheduleName
    from soapjax.strategy.space import RECOMPUTE_POLICIES, RecomputePolicy
    from soapjax.topology.cluster import CAPABILITIES, PLATFORMS, Platform

    assert typing.get_args(ScheduleName) == tuple(SCHEDULES)
    assert DEFAULT_SCHEDULE in SCHEDULES
    assert typing.get_args(AttentionImplementation) == IMPLEMENTATIONS
    assert typing.get_args(RecomputePolicy) == RECOMPUTE_POLICIES
    # what a platform's XLA does is asked of the topology, one row per platform
    assert set(CAPABILITIES) == set(PLATFORMS) == set(typing.get_args(Platform))


def _module_level_edges(name: str, names: set[str]) -> set[str]:
    """The soapjax modules `name` imports at module level (``from soapjax.graph import _dims``
    is an edge to ``graph._dims``; a name that is no module, to the module or package it is
    read from)."""
    def module(dotted: str) -> str | None:
        rel = dotted.removeprefix("soapjax").lstrip(".")
        if not rel:
            return "__init__"
        if rel in names:
            return rel
        return f"{rel}.__init__" if f"{rel}.__init__" in names else None

    out = set()
    for node in ast.parse(_path(name).read_text()).body:
        if isinstance(node, ast.Import):
            out |= {m for a in node.names if a.name.startswith("soapjax.")
                    and (m := module(a.name))}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level \
                and node.module.split(".")[0] == "soapjax":
            for a in node.names:
                m = module(f"{node.module}.{a.name}") or module(node.module)
                if m:
                    out.add(m)
    return out - {name}


def test_module_level_imports_have_no_cycle():
    """Within a stage, modules may import each other, but never round in a circle: a cycle
    works only by the order Python happens to import in. (A package's ``__init__`` importing
    its own modules is how a package is read, not a cycle of theirs.)"""
    names = set(_modules())
    graph = {name: _module_level_edges(name, names) for name in names}
    for name in names:
        package = name.removesuffix(".__init__")
        if name.endswith(".__init__"):
            for other in names:
                if other.startswith(package + "."):
                    graph[other].discard(name)
    seen: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in seen:
                visit(nxt, path + [nxt])
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            visit(node, [node])

"""notebooks/quickstart.ipynb runs clean, top to bottom, without Jupyter.

The test reads the notebook's JSON and runs its code cells in order in one fresh Python process
(so the notebook's own `XLA_FLAGS` set-up is what gives it 8 devices: the variables pytest set
are removed), with `exec` in one shared namespace. Like Jupyter, it then "displays" each cell's
last expression: `_repr_html_()` for objects that have one, a PNG render for matplotlib figures.
Any exception fails the test, naming the cell.
"""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"

RUNNER = r'''
import ast, io, json, sys, traceback

cells = [c for c in json.load(open(sys.argv[1]))["cells"] if c["cell_type"] == "code"]
namespace = {"__name__": "__main__"}
shown = []
for k, cell in enumerate(cells):
    source = "".join(cell["source"])
    try:
        tree = ast.parse(source, filename=f"<cell {k}>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, f"<cell {k}>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), f"<cell {k}>", "eval"), namespace)
            if type(value).__name__ == "Figure":  # its _repr_html_ is None outside webagg
                buf = io.BytesIO()
                value.savefig(buf, format="png")
                assert buf.getvalue()[:4] == b"\x89PNG"
                shown.append(f"{k}:png")
            elif hasattr(value, "_repr_html_"):
                html = value._repr_html_()
                assert isinstance(html, str) and html.startswith("<"), html
                shown.append(f"{k}:html:{type(value).__name__}")
            else:
                repr(value)
                shown.append(f"{k}:repr")
    except BaseException:
        print(f"code cell {k} failed:\n{source}\n", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
print(json.dumps(shown))
'''


def test_notebook_is_clean_json():
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["nbformat"] == 4 and nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(code) >= 6
    # no stored outputs that could disagree with the code
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    # no IPython-only syntax, which the test's exec (and a plain Python reader) cannot run
    lines = [line for c in code for line in "".join(c["source"]).splitlines()]
    assert not [line for line in lines if line.lstrip().startswith(("%", "!"))]
    # XLA_FLAGS is set before jax is imported anywhere
    first = "".join(code[0]["source"])
    assert first.index("xla_force_host_platform_device_count") < first.index("import jax")


def test_notebook_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env |= {"MPLBACKEND": "Agg", "SOAPJAX_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(NOTEBOOK)], cwd=NOTEBOOK.parent,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shown = json.loads(proc.stdout.strip().splitlines()[-1])
    kinds = [s.split(":", 1)[1] for s in shown]
    # the graph and the plan show as HTML tables; four kinds of pictures render (plans,
    # timeline, comparison, a pipeline's schedule)
    assert kinds.count("html:OpGraph") == 1 and kinds.count("html:Plan") == 1
    assert kinds.count("png") == 5

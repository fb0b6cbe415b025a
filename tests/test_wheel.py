"""soapjax as a user installs it: the wheel built from this checkout, installed into a fresh
environment outside the checkout, plans with its shipped topologies.

The fresh environment is a new venv that sees the test environment's dependencies (jax, flax,
optax, numpy: a ``.pth`` line naming their folder, which does not run the checkout's editable
install) and nothing of the checkout: soapjax comes from the wheel alone, and every command runs
from a temporary folder, so nothing is read from the source tree.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin folder of a fresh venv with the wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(ROOT),
                  "-w", str(tmp / "dist")], cwd=tmp)
    wheels = list((tmp / "dist").glob("soapjax-*.whl"))
    assert len(wheels) == 1, built.stdout
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    purelib = Path(subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    (purelib / "test-deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
          "--no-deps", "-q", str(wheels[0])], cwd=tmp)
    return venv / "bin"


def test_the_installed_package_is_the_wheel_not_the_checkout(installed, tmp_path):
    out = _run([str(installed / "python"), "-c",
                "import soapjax, soapjax_zoo; print(soapjax.__file__); "
                "print(soapjax_zoo.__file__)"], cwd=tmp_path)
    for line in out.stdout.split():
        assert str(installed.parent) in line and str(ROOT) not in line, out.stdout


def test_the_installed_command_lists_the_shipped_topologies(installed, tmp_path):
    out = _run([str(installed / "soapjax"), "meshes"], cwd=tmp_path)
    for name in ("cpu8", "dgx-h100x8", "p100x16", "k80x64"):
        assert f"\n{name} " in out.stdout, out.stdout


def test_the_installed_command_plans(installed, tmp_path):
    out = _run([str(installed / "soapjax"), "plan", "--model", "mlp", "--size", "tiny",
                "--mesh", "cpu8", "--costs", "analytic", "--budget", "2",
                "--out", str(tmp_path / "plan.json")], cwd=tmp_path)
    assert (tmp_path / "plan.json").is_file(), out.stdout
    assert "cpu8" in out.stdout


def test_the_installed_library_plans(installed, tmp_path):
    code = """
import jax, jax.numpy as jnp, soapjax
def loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)
p = {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 4))}
b = {"x": jnp.ones((8, 16)), "y": jnp.ones((8, 4))}
g = soapjax.trace(loss, p, b, name="mlp")
plan = soapjax.find_plan(g, soapjax.load_topology("dgx-h100x8"),
                         settings=soapjax.SearchSettings(max_proposals=20), costs="analytic")
print(plan.topology, plan.step_time_s > 0)
"""
    out = _run([str(installed / "python"), "-c", code], cwd=tmp_path)
    assert out.stdout.split()[-2:] == ["dgx-h100x8", "True"], out.stdout

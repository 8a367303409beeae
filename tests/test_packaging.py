"""`pip install .` builds a wheel with the right metadata: version, extras, both packages with their
py.typed markers, the SGLang plug-in entry point, and nothing else (no tests, no benchmarks)."""

import email
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import jax_attn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built offline (the venv's setuptools) from a copy of what the build reads."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    for pkg in ("jax_attn", "torch_bridge"):
        shutil.copytree(os.path.join(ROOT, pkg), src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    (path,) = out.glob("*.whl")
    return zipfile.ZipFile(path)


DIST = f"jax_attn-{jax_attn.__version__}.dist-info"


def test_wheel_metadata(wheel):
    meta = email.message_from_bytes(wheel.read(f"{DIST}/METADATA"))
    assert meta["Name"] == "jax_attn" and meta["Version"] == jax_attn.__version__
    assert meta["Requires-Python"] == "<3.13,>=3.12"
    assert set(meta.get_all("Provides-Extra")) == {"cuda", "torch", "test", "models"}
    requires = meta.get_all("Requires-Dist")
    for req in ("jax==0.11.2", "jaxlib==0.11.2", 'jax[cuda13]==0.11.2; extra == "cuda"',
                'torch==2.11.0; extra == "torch"'):
        assert req in requires, requires
    assert "Typing :: Typed" in meta.get_all("Classifier")
    assert meta.get_payload().startswith("# jax_attn")  # the README


def test_wheel_contents(wheel):
    names = wheel.namelist()
    assert {"jax_attn/py.typed", "torch_bridge/py.typed", "jax_attn/kernels/__init__.py",
            "torch_bridge/sglang_plugin.py"} <= set(names)
    assert {n.split("/")[0] for n in names} == {"jax_attn", "torch_bridge", DIST}
    entry_points = wheel.read(f"{DIST}/entry_points.txt").decode()
    assert "[sglang.srt.plugins]\njax_attn = torch_bridge.sglang_plugin:register" in entry_points

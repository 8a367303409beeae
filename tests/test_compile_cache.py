"""The persistent compilation cache (``jax_attn.compile_cache``): private directories only, opt-out and
location override, and a second process reuses the first one's executables and built kernels."""

import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings

import jax
import pytest

from jax_attn import compile_cache
from jax_attn.compile_cache import InsecureCacheDir, enable, insecure_reason, secure_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAX_FLAGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture
def jax_cache_config(monkeypatch):
    """No JAX cache directory configured during the test (nothing compiles in it); restored after."""
    saved = {name: getattr(jax.config, name) for name in JAX_FLAGS}
    jax.config.update("jax_compilation_cache_dir", None)
    for name in (compile_cache.ENV_SWITCH, compile_cache.ENV_DIR):
        monkeypatch.delenv(name, raising=False)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_default_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_dir() == os.path.join(str(tmp_path), "jax_attn")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored, as the XDG spec says
    assert compile_cache.default_dir() == os.path.join(os.path.expanduser("~"), ".cache", "jax_attn")


def test_creates_private_directories(tmp_path):
    path = tmp_path / "a" / "b"
    assert secure_dir(str(path)) == os.path.realpath(path)
    assert _mode(tmp_path / "a") == 0o700 and _mode(path) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_refuses_directory_others_can_write(tmp_path, mode):
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(mode)
    assert "writable by its group or other users" in insecure_reason(str(path))
    with pytest.raises(InsecureCacheDir):
        secure_dir(str(path))


def test_refuses_directory_under_a_writable_parent(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)  # anyone could rename ours away and plant their own
    (parent / "cache").mkdir(mode=0o700)
    assert "without the sticky bit" in insecure_reason(str(parent / "cache"))
    parent.chmod(0o777 | stat.S_ISVTX)  # sticky, as /tmp: others cannot touch what we own
    assert insecure_reason(str(parent / "cache")) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another user needs root")
def test_refuses_directory_of_another_user(tmp_path):
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, 65534, 65534)
    assert "not by this user" in insecure_reason(str(path))


def test_enable_warns_and_stays_off_for_unsafe_dir(tmp_path, jax_cache_config):
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(0o777)
    with pytest.warns(UserWarning, match="refusing the compilation cache directory"):
        assert enable(str(path)) is None
    assert jax.config.jax_compilation_cache_dir is None
    with pytest.raises(InsecureCacheDir):
        enable(str(path), strict=True)


def test_enable_location_override_and_settings(tmp_path, monkeypatch, jax_cache_config):
    monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "cc"))
    got = enable()
    assert got == os.path.realpath(tmp_path / "cc" / "xla") == jax.config.jax_compilation_cache_dir
    assert _mode(tmp_path / "cc") == 0o700 and _mode(got) == 0o700
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    assert compile_cache.kernel_dir() == os.path.join(got, compile_cache.KERNEL_SUBDIR)
    assert _mode(compile_cache.kernel_dir()) == 0o700


def test_opt_out(tmp_path, monkeypatch, jax_cache_config):
    monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "cc"))
    for value in ("0", "false", "OFF", "no"):
        monkeypatch.setenv(compile_cache.ENV_SWITCH, value)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert enable() is None
        assert jax.config.jax_compilation_cache_dir is None and compile_cache.kernel_dir() is None
    assert not (tmp_path / "cc").exists()


# A process that compiles a small function and lowers a small Mosaic GPU kernel for CUDA (no GPU needed),
# then reports JAX's persistent-cache hits and the kernel cache's counts.
CHILD = textwrap.dedent("""
    import hashlib, json
    import jax, jax.numpy as jnp
    from jax_attn import compile_cache
    from jax_attn.kernels import kernel_cache
    from jax_attn.kernels.mosaic_kernel import kernel_call
    from jax_attn.kernels.mosaic_paged import kernel_statics

    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(1) if event == "/jax/compilation_cache/cache_hits" else None)
    where = compile_cache.enable()
    jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) * 2 + 1)(jnp.arange(8.0)))
    st = kernel_statics(num_tokens=2, num_q_heads=4, num_kv_heads=1, head_dim=64, head_dim_v=64, page_size=16,
                        pack=4, dtype=jnp.bfloat16, max_q_len=1)
    s = jax.ShapeDtypeStruct
    cache = s((9, 16, 1, 64), jnp.bfloat16)
    args = (s((2, 1, 4, 64), jnp.bfloat16), cache, cache, s((2, 4), jnp.int32), s((3,), jnp.int32),
            s((2, 8), jnp.int32), s((1,), jnp.float32))
    hlo = jax.jit(kernel_call(st, 2)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    counts = {event: n for (event, _), n in kernel_cache.stats().items()}
    print(json.dumps(dict(where=where, hits=len(hits), kernel=counts, hlo=hashlib.sha256(hlo.encode()).hexdigest())))
""")


def _child(cache_root: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ATTN_COMPILE_CACHE_DIR=cache_root, PYTHONPATH=ROOT)
    env.pop(compile_cache.ENV_SWITCH, None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_reuses_executables_and_kernels(tmp_path):
    root = str(tmp_path / "cc")
    first = _child(root)
    assert first["where"] == os.path.realpath(os.path.join(root, "xla"))
    assert first["hits"] == 0 and first["kernel"] == {"build": 1}
    second = _child(root)
    assert second["hits"] >= 1, "the second process must load the executable from the cache"
    assert second["kernel"] == {"disk": 1}, "the second process must not lower the kernel again"
    assert second["hlo"] == first["hlo"]
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    assert files and all(_mode(d) == 0o700 for d, _, _ in os.walk(root))


def test_prebuild_worker_program_runs(tmp_path):
    """The program ``kernel_cache.prebuild`` starts per worker imports and answers (an empty share: an
    empty list back), without the double-import warning of ``python -m``. Catches a worker command that
    no longer runs: every prebuild would then fall back to building serially, silently."""
    import pickle

    from jax_attn.kernels import kernel_cache
    inp, out = tmp_path / "0.in", tmp_path / "0.out"
    inp.write_bytes(pickle.dumps([]))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", kernel_cache._WORKER, str(inp), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert pickle.loads(out.read_bytes()) == []
    assert "RuntimeWarning" not in proc.stderr, proc.stderr

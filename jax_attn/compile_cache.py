"""The persistent compilation cache: compiled executables and built kernels kept across processes.

``enable()`` turns on JAX's persistent compilation cache in a per-user directory and makes it keep
every executable, however quick its compile (JAX's defaults skip those under one second). The
Mosaic GPU kernels' lowered modules go beside them (``kernel_dir``, used by
``jax_attn.kernels.kernel_cache``), so a second process skips both the XLA compile and the Python
lowering of each kernel. The examples, ``StepRunner.capture`` and the torch bridge call it.

Location: ``$JAX_ATTN_COMPILE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/jax_attn`` (an absolute
``XDG_CACHE_HOME`` only), else ``~/.cache/jax_attn``; executables in its ``xla/`` subdirectory.
Opt out with ``JAX_ATTN_COMPILE_CACHE=0`` (also ``false``, ``off``, ``no``). A JAX cache directory
configured before (``jax_compilation_cache_dir``, ``JAX_COMPILATION_CACHE_DIR``) is left as it is,
and the kernel modules go into it.

Security: a cache entry is code that the process will run, so whoever can write to the directory
can run code as its user. Directories are created with mode 0700. A directory that is not owned by
the user, that its group or other users can write to, or that sits under such a directory (other
than a sticky one such as ``/tmp``) is refused: ``enable()`` warns and runs without the cache (a
server keeps serving, only slower to start); ``enable(strict=True)`` raises ``InsecureCacheDir``.
"""

from __future__ import annotations

import os
import stat
import warnings
from typing import Optional

import jax

ENV_SWITCH = "JAX_ATTN_COMPILE_CACHE"  # "0", "false", "off" or "no": no persistent cache
ENV_DIR = "JAX_ATTN_COMPILE_CACHE_DIR"  # the cache's root directory
XLA_SUBDIR = "xla"
KERNEL_SUBDIR = "jax_attn_kernels"  # inside JAX's cache directory
_OFF = ("0", "false", "off", "no")


class InsecureCacheDir(PermissionError):
    """The cache directory (or a parent) can be written by other users."""


def default_dir() -> str:
    """``$XDG_CACHE_HOME/jax_attn`` (absolute ``XDG_CACHE_HOME`` only), else ``~/.cache/jax_attn``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax_attn")


def opted_out() -> bool:
    """Whether ``JAX_ATTN_COMPILE_CACHE`` turns the cache off."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() in _OFF


def insecure_reason(path: str) -> Optional[str]:
    """Why other users could plant entries in the existing directory ``path``, or None if they cannot.

    The directory must be owned by this user and not writable by its group or others; each parent must
    be owned by this user or root and, if its group or others can write to it, carry the sticky bit
    (then nobody else can rename or replace what this user owns in it).
    """
    real = os.path.realpath(path)
    uid = os.geteuid()
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        return f"{real} is not a directory"
    if st.st_uid != uid:
        return f"{real} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{real} is writable by its group or other users (mode {stat.S_IMODE(st.st_mode):o}; chmod 700 it)"
    parent = os.path.dirname(real)
    while True:
        pst = os.stat(parent)
        if pst.st_uid not in (uid, 0):
            return f"parent {parent} is owned by uid {pst.st_uid}, not by this user or root"
        if pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not pst.st_mode & stat.S_ISVTX:
            return f"parent {parent} is writable by other users without the sticky bit"
        if parent == os.path.dirname(parent):
            return None
        parent = os.path.dirname(parent)


def secure_dir(path: str) -> str:
    """Create ``path`` (and missing parents) with mode 0700 and check it (``insecure_reason``).

    Returns the real path. Raises ``InsecureCacheDir`` when other users could write into it.
    """
    path = os.path.abspath(os.path.expanduser(path))
    missing = []
    p = path
    while not os.path.exists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)  # the umask can only remove bits: never wider than 0700
        except FileExistsError:
            pass  # another process made it: checked below like any existing directory
    reason = insecure_reason(path)
    if reason is not None:
        raise InsecureCacheDir(f"refusing the compilation cache directory: {reason}. Cache entries are code this "
                               f"process runs; use a private directory ({ENV_DIR}=...) or {ENV_SWITCH}=0")
    return os.path.realpath(path)


def enable(path: Optional[str] = None, *, strict: bool = False) -> Optional[str]:
    """Turn on the persistent compilation cache (idempotent; see the module docstring).

    Args:
      path: the cache's root directory; default ``$JAX_ATTN_COMPILE_CACHE_DIR``, else ``default_dir()``.
      strict: raise ``InsecureCacheDir`` for an unsafe directory instead of warning and running without it.
    Returns:
      JAX's cache directory in use, or None when the cache is off (opted out, or an unsafe directory).
    """
    if opted_out():
        return None
    configured = jax.config.jax_compilation_cache_dir
    if configured is None:
        root = path or os.environ.get(ENV_DIR) or default_dir()
        try:
            xla_dir = secure_dir(os.path.join(secure_dir(root), XLA_SUBDIR))
        except InsecureCacheDir as e:
            if strict:
                raise
            warnings.warn(f"{e}; running without the persistent compilation cache", stacklevel=2)
            return None
        jax.config.update("jax_compilation_cache_dir", xla_dir)
        configured = xla_dir
    # Keep every executable: a decode step of a small model compiles in under JAX's default one
    # second, and a server captures dozens of them.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return configured


def kernel_dir() -> Optional[str]:
    """The directory for built Mosaic GPU kernels: ``KERNEL_SUBDIR`` in JAX's cache directory while
    JAX's persistent cache is on and not opted out, else None (also, with a warning, when it is unsafe)."""
    root = jax.config.jax_compilation_cache_dir
    if root is None or "://" in root or not jax.config.jax_enable_compilation_cache or opted_out():
        return None  # (a remote JAX cache, gs://...: kernels are not kept)
    path = os.path.join(root, KERNEL_SUBDIR)
    try:
        return _checked(path)
    except (InsecureCacheDir, OSError) as e:
        _warn_once(path, f"jax_attn: not keeping built kernels in {path}: {e}")
        return None


_CHECKED: dict = {}


def _checked(path: str) -> str:
    """``secure_dir(path)``, once per path and process (a lowering asks for every kernel)."""
    hit = _CHECKED.get(path)
    if hit is None:
        hit = _CHECKED[path] = secure_dir(path)
    return hit


def _warn_once(key: str, message: str) -> None:
    if ("warned", key) not in _CHECKED:
        _CHECKED[("warned", key)] = True
        warnings.warn(message, stacklevel=3)

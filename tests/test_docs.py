"""docs/ stays true: every public name is in docs/api.md (in its module's section), the links between
the docs and from the README resolve, and nothing points outside the repository."""

import importlib
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")

# Modules whose public names docs/api.md documents. None: the module's ``__all__`` when it has one,
# else every class and function it defines whose name has no leading underscore. A list: the
# module's public entry points (kernel modules, whose other names are the kernel's own helpers).
MODULES = {
    "jax_attn": None,
    "jax_attn.backend": None,
    "jax_attn.batch": None,
    "jax_attn.capture": None,
    "jax_attn.metadata": None,
    "jax_attn.attention": None,
    "jax_attn.plan_key": None,
    "jax_attn.kernels": None,
    "jax_attn.kernels.triton_paged": ["paged_attention"],
    "jax_attn.kernels.mosaic_paged": ["paged_attention_mosaic", "supports", "MosaicConfig"],
    "jax_attn.kernels.merge_state": ["merge_state", "merge_splits"],
    "jax_attn.kernels.config": ["KernelConfig", "DEFAULT_CONFIG"],
    "jax_attn.kernels.schedule": ["build_schedule", "plan_schedule"],
    "torch_bridge": None,
    "torch_bridge.sglang_plugin": None,
}


def public_names(module: str, listed) -> list:
    m = importlib.import_module(module)
    if listed is not None:
        missing = [n for n in listed if not hasattr(m, n)]
        assert not missing, f"{module} has no {missing}: update MODULES in tests/test_docs.py and docs/api.md"
        return list(listed)
    if hasattr(m, "__all__"):
        return list(m.__all__)
    return sorted(n for n, o in vars(m).items() if not n.startswith("_") and callable(o)
                  and not isinstance(o, type(m)) and getattr(o, "__module__", None) == module)


def sections(text: str) -> dict:
    """``## `module` ...`` heading -> the section's text (a heading may name several modules)."""
    out = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        for mod in re.findall(r"`([\w.]+)`", heading):
            out[mod] = body
    return out


def code_spans(text: str) -> list:
    """The fenced blocks and the inline `code` spans of a Markdown text (spans may wrap lines)."""
    fenced = re.findall(r"^```.*?^```", text, flags=re.M | re.S)
    inline = re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
    return fenced + inline


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_public_name_is_in_api_md(module):
    body = sections(read("docs/api.md")).get(module)
    assert body is not None, f"docs/api.md has no '## `{module}`' section"
    spans = code_spans(body)
    undocumented = [n for n in public_names(module, MODULES[module])
                    if not any(re.search(rf"\b{re.escape(n)}\b", s) for s in spans)]
    assert not undocumented, f"docs/api.md's `{module}` section does not mention {undocumented}"


def test_api_md_names_only_what_exists():
    """Every ``module.name`` written in api.md resolves (a renamed function fails here too)."""
    text = read("docs/api.md")
    for dotted in set(re.findall(r"`((?:jax_attn|torch_bridge)(?:\.\w+)+)", text)):
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                assert hasattr(obj, attr), f"docs/api.md names `{dotted}`, which does not exist"
                obj = getattr(obj, attr)
            break


def markdown_files():
    return ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(DOCS)) if f.endswith(".md")]


@pytest.mark.parametrize("path", markdown_files())
def test_relative_links_resolve(path):
    """Links to files of the repository exist; none leaves the repository."""
    here = os.path.dirname(os.path.join(ROOT, path))
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", read(path)):
        if re.match(r"[a-z]+://", target):
            continue
        full = os.path.normpath(os.path.join(here, target))
        assert full.startswith(ROOT + os.sep), f"{path} links outside the repository: {target}"
        assert os.path.exists(full), f"{path} links to a missing file: {target}"


def test_readme_links_every_doc():
    readme = read("README.md")
    unlinked = [f for f in sorted(os.listdir(DOCS)) if f.endswith(".md") and f"(docs/{f}" not in readme]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_nothing_refers_outside_the_repository():
    """No text file of the repository names ../shared or a DESIGN.md (neither is in the repository)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for f in files:
        text_file = f.endswith((".py", ".md", ".sh", ".toml", ".txt", ".cfg")) or f in ("Makefile", ".ci/run")
        if f == "tests/test_docs.py" or not text_file:
            continue
        try:
            text = read(f)
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for pattern in ("../shared", "shared/tools", "DESIGN.md"):
            if pattern in text:
                hits.append(f"{f}: {pattern}")
    assert not hits, hits

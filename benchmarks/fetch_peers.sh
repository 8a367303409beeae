#!/usr/bin/env bash
# Fetches the peer kernels the benchmarks compare against into DIR (default .peers, git-ignored).
#
#   bash benchmarks/fetch_peers.sh [DIR]
#
# DIR gets:
#   sglang/srt/layers/attention/triton_ops/   SGLang 0.5.11's Triton decode / extend kernels (pure
#       Python, from its wheel), importable with DIR on PYTHONPATH as
#       sglang.srt.layers.attention.triton_ops.{decode_attention,extend_attention}; a two-function
#       sglang/srt/utils.py (is_hip, is_cuda) stands in for the rest of SGLang.
#   wheels/   flash-attn3-jax 0.2.3 (FA3's flash_attn_with_kvcache, the kernel SGLang's FA3 backend
#       calls, as an XLA FFI binding: Hopper, bf16/f16, paged KV) and einops, as wheels. They stay
#       packed so DIR fits the device tool's carry limit; unpack them on the GPU machine with
#   peer_site.sh   `eval "$(bash DIR/peer_site.sh DIR)"`: unpacks DIR/wheels once into a folder
#       under ${TMPDIR:-/tmp} and prints the PYTHONPATH export for it.
# SRC (default .sglang-src, git-ignored; NO_SRC=1 skips it) gets SGLang 0.5.11's srt/ source, for
# reading the engine contract only (docs/sglang_contract.md); do not carry it to the GPU machine.
#
# Needs pip and the package registry. Nothing fetched here may be committed.
set -euo pipefail

DIR="${1:-.peers}"
SRC="${SRC:-.sglang-src}"
PYTHON="${PYTHON:-python3}"
SGLANG_VERSION=0.5.11
FA3_JAX_VERSION=0.2.3
EINOPS_VERSION=0.8.2

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# SGLang's wheel: only its Triton attention kernels are used (and its source, to read).
"$PYTHON" -m pip download --no-deps --quiet --dest "$work" "sglang==$SGLANG_VERSION"
"$PYTHON" -m zipfile -e "$work"/sglang-"$SGLANG_VERSION"-*.whl "$work/sglang-wheel" >/dev/null
attn="$DIR/sglang/srt/layers/attention"
mkdir -p "$attn"
rm -rf "$attn/triton_ops"
cp -r "$work/sglang-wheel/sglang/srt/layers/attention/triton_ops" "$attn/"
for pkg in "$DIR/sglang" "$DIR/sglang/srt" "$DIR/sglang/srt/layers" "$attn"; do
  : > "$pkg/__init__.py"
done
cat > "$DIR/sglang/srt/utils.py" <<'PY'
"""Stand-in for sglang.srt.utils: the two functions SGLang's Triton attention kernels import."""


def is_hip():
    return False


def is_cuda():
    return True
PY

if [ "${NO_SRC:-0}" != 1 ]; then
  mkdir -p "$SRC"
  rm -rf "$SRC/srt"
  cp -r "$work/sglang-wheel/sglang/srt" "$SRC/srt"
fi

# FA3 through JAX, for Python 3.12 on x86-64 Linux whatever this machine is.
mkdir -p "$DIR/wheels"
"$PYTHON" -m pip download --no-deps --quiet --dest "$DIR/wheels" --only-binary=:all: \
  --python-version 3.12 --platform manylinux_2_28_x86_64 \
  "flash-attn3-jax==$FA3_JAX_VERSION" "einops==$EINOPS_VERSION"

# The unpack step that runs on the GPU machine (the repository's benchmarks/ travels there too, but
# DIR is what the instructions name).
cat > "$DIR/peer_site.sh" <<'SH'
#!/usr/bin/env bash
# Unpacks the wheels in DIR/wheels (once) and prints the PYTHONPATH export that makes them importable:
#   eval "$(bash .peers/peer_site.sh .peers)"
set -euo pipefail
DIR="${1:-.peers}"
site="${TMPDIR:-/tmp}/jax_attn_peer_site"
mkdir -p "$site"
for wheel in "$DIR"/wheels/*.whl; do
  [ -e "$wheel" ] || continue
  done_mark="$site/.unpacked-$(basename "$wheel")"
  if [ ! -f "$done_mark" ]; then
    python3 -m zipfile -e "$wheel" "$site" >/dev/null
    touch "$done_mark"
  fi
done
echo "export PYTHONPATH=\"$site:\${PYTHONPATH:-}\""
SH
chmod +x "$DIR/peer_site.sh"

echo "peers in $DIR:"
echo "  SGLang $SGLANG_VERSION Triton kernels: PYTHONPATH=.:$DIR, import sglang.srt.layers.attention.triton_ops"
echo "  FA3 (flash-attn3-jax $FA3_JAX_VERSION) wheels in $DIR/wheels: on the GPU machine run"
echo "    eval \"\$(bash $DIR/peer_site.sh $DIR)\""
[ "${NO_SRC:-0}" = 1 ] || echo "  SGLang $SGLANG_VERSION source to read (not importable): $SRC/srt"

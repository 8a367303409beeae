"""Which kernel runs a call: the one policy both front ends use.

``impl``:
  ``"auto"``      the Mosaic GPU kernel on Hopper GPUs for prefill/extend, for decode of few
                  tokens and for MLA latent caches (``mosaic_wanted``) when it covers the call (bf16/f16,
                  head dims that are multiples of 16 up to 192 and 256, latent caches of 512 + 64 and
                  alike, page size a multiple of 8, or 1, 2, 4 for prefill/extend at head dims that
                  are multiples of 64 and for latent caches (``gathered_rows_wanted``), no fp8 descale, no sinks
                  on packed decode rows (``packed_sinks_wanted``: the kernel takes them, slower),
                  not deterministic mode), else the Triton-lowered
                  kernel (interpret mode on CPU): every other head dim goes there;
  ``"triton"``    the Pallas kernel lowered through Triton (any page size, every feature, head dims
                  that are multiples of 8 up to 256 or powers of 2, K and V alike or not; padded to a
                  power of 2 inside the kernel: ``jax_attn.kernels.triton_paged.unsupported``);
  ``"mosaic"``    the Pallas Mosaic GPU kernel for Hopper (raises ``NotImplementedError`` for what
                  it does not cover: see ``jax_attn.kernels.mosaic_paged.supports``);
  ``"reference"`` the plain-``jnp`` float32 reference.

The torch bridge asks ``select_kernel(..., from_torch=True)``: torch launches (and captures in a CUDA
graph) the Mosaic kernel for every call it covers on Hopper (at pages of 1, 2, 4: prefill/extend and MLA
latent caches only; decode and verify rows only where the query-head group packs into its rows), split-KV
where its unsplit tiles cannot fill the GPU as in the JAX API, else the Triton-lowered kernel for every call
it covers (``triton_launchable``: fp8 pools and MLA latent caches included); the rest go through a compiled
JAX executable, which applies this policy again with ``from_torch=False``.
One capability check per kernel family, kept beside its kernel: ``mosaic_paged.unsupported`` (and
``supports``) for the Mosaic kernel (``mosaic_covers`` asks it here), ``triton_paged.unsupported``
for the Triton-lowered one, which a call the Mosaic kernel does not cover goes to (its kernel raises
with that reason when it does not take the call either).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

IMPLS = ("auto", "triton", "mosaic", "reference")
_HOPPER = ("H100", "H200", "H800", "H20", "GH200")


def resolve_impl(impl: str) -> str:
    """Check ``impl``; ``auto`` stays ``auto`` (each call picks a kernel, see ``select_kernel``)."""
    if impl not in IMPLS:
        raise ValueError(f"{impl=} must be one of {IMPLS}")
    return impl


@functools.cache
def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (the Mosaic kernel's target)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and any(name in dev.device_kind for name in _HOPPER)


@dataclasses.dataclass(frozen=True)
class Call:
    """What the policy needs to know about one attention call (static facts only)."""

    max_q_len: int  # static bound on queries per sequence
    page_size: int
    num_tokens: int  # padded token count (0: unknown)
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: object  # q's dtype (anything jnp.dtype takes)
    kv_dtype: object
    has_sinks: bool = False
    fp8_descale: bool = False
    deterministic: bool = False  # one KV split per sequence (SGLang's deterministic inference)
    num_q_heads: int = 0  # 0: unknown
    latent: bool = False  # absorbed MLA over one latent cache (values = the latent part of each key row)

    @property
    def group(self) -> int:
        """Query heads per kv head (1 when the query heads are unknown)."""
        return self.num_q_heads // self.num_kv_heads if self.num_q_heads else 1


def mosaic_wanted(call: Call) -> bool:
    """``auto``'s speed rule: Mosaic on Hopper for query runs longer than the packed-decode bound,
    and for decode (short query runs) whose (token, kv head) programs fit in one wave of the GPU
    (unknown token counts stay on Triton).

    On an H100 (page 16, 32/8 heads, benchmarks/RESULTS.md) the Mosaic kernel is ahead of the
    Triton one at 1 x 32768 (split decode) and 8 x 8192, about level at 64 x 4096 and behind at
    256 x 1024: decode buckets of many tokens stay on Triton. Decode of a query-head group that does not
    divide the kernel's row block stays on Triton too, and its verify rows go to Mosaic whatever the batch
    (``packed_rows_wanted``). Deterministic mode keeps one
    kernel for every batch (bitwise batch invariance). MLA latent caches go to Mosaic whatever the batch (H200,
    page 64, B64 ctx 4096, ``benchmarks/bench_mla.py``, 2026-11-28: decode at 16 heads 3.41 TB/s against
    Triton's 2.60, at 128 heads 528 TFLOP/s against 153, MTP verify q 2 at 128 heads 525 against 188).
    """
    from jax_attn.kernels.mosaic_paged import DEFAULT_MOSAIC_CONFIG as config

    if call.deterministic or not on_hopper() or not (gathered_rows_wanted(call) and packed_sinks_wanted(call)
                                                     and packed_rows_wanted(call)):
        return False
    if call.max_q_len > config.pack_max_q_len or call.latent or unaligned_group(call):
        return True  # (an unaligned group's short runs here are verify rows: ``packed_rows_wanted``)
    return 0 < call.num_tokens * call.num_kv_heads <= config.num_sms


def unaligned_group(call: Call) -> bool:
    """Whether the call's query-head group does not divide the Mosaic kernel's 64-row block (Llama 4's 40 / 8
    heads, Qwen2.5-7B's 28 / 4)."""
    from jax_attn.kernels.mosaic_paged import DEFAULT_MOSAIC_CONFIG as config

    return call.group > 1 and config.block_q % call.group != 0


def packed_rows_wanted(call: Call) -> bool:
    """False for decode rows (one query per sequence) whose query-head group does not divide the Mosaic
    kernel's 64-row block (``unaligned_group``), and for short query runs of such a group that the kernel
    cannot pack (``mosaic_paged.pack_for``: more tokens than ``block_q // G``). Unpacked, one query head per
    row block reads each key block G times (H100, page 16, decode 64 x 4096, issue #35's table: 40 / 8 heads
    0.92 TB/s against Triton's 2.98, 28 / 4 heads 0.68 against 2.88).

    Packed (``pack_for``), on an H200 (page 16, ``benchmarks/bench_attention.py --only decode,verify --quick
    --heads 40/8`` and ``28/4``, 2026-11-29, thirty-second session), TB/s, Mosaic against Triton (FA3):
    verify 32 x 4 on 2048 3.79 against 3.29 (3.50) at 40 / 8, 3.57 against 2.26 (3.19) at 28 / 4, so verify
    rows go there; decode 64 x 4096 4.27 against 4.37 and 4.13 against 4.22, 1 x 32768 3.57 against 3.39 and
    2.10 against 2.36, so decode stays on Triton. Prefill rows (one head each) and latent caches pass."""
    from jax_attn.kernels.mosaic_paged import DEFAULT_MOSAIC_CONFIG as config, pack_for

    if call.latent or call.max_q_len > config.pack_max_q_len or not unaligned_group(call):
        return True
    return call.max_q_len > 1 and pack_for(call.group, call.max_q_len, config) > 1


def gathered_rows_wanted(call: Call) -> bool:
    """False for the calls the Mosaic kernel is slower on because of their page size: at pages of 1, 2 or 4
    rows its producer gathers rows with ``cp.async`` (``KernelStatics.gathers_rows``), and only long query
    runs (prefill, extend) go there; pages that are multiples of 8 always pass. On an H200, in one run of
    ``benchmarks/bench_attention.py --page-size 1`` (32/8 heads, d 128, 2026-11-29, thirty-second session;
    issue #34's table), Mosaic against Triton: prefill B4 S4096 538 against 376 TFLOP/s (FA3 570), extend 1024
    on 4096 565 against 394, 512 on 4096 570 against 385; decode TB/s 64 x 4096 3.75 against 4.22, 1 x 32768
    3.23 against 3.29, 8 x 8192 2.94 against 3.48, 256 x 1024 3.39 against 4.05; verify 32 x 4 on 2048 3.46
    against 3.63 (Triton keeps decode and verify).
    An MLA latent cache's decode and verify go there too. On an H200 (page 1, B64 ctx 4096,
    ``benchmarks/bench_mla.py``, 2026-11-29), against SGLang's Triton MLA: 128 heads decode Mosaic 5.30x
    (500 TFLOP/s; MTP verify q 2: 507), Triton 1.65x (2026-11-28: 156 TFLOP/s; verify 195); 16 heads decode
    (memory-bound) Mosaic 1.30x (3.39 TB/s), Triton 0.99x (2.53)."""
    from jax_attn.kernels.mosaic_paged import DEFAULT_MOSAIC_CONFIG as config

    return call.page_size % 8 == 0 or call.max_q_len > config.pack_max_q_len or call.latent


def mosaic_covers(call: Call) -> bool:
    """Whether the Mosaic kernel takes this call at all (its capability rules)."""
    from jax_attn.kernels.mosaic_paged import latent_unsupported, pack_for, unsupported

    if call.fp8_descale:
        return False
    if call.latent:
        return latent_unsupported(call.dtype, call.kv_dtype, call.head_dim, call.head_dim_v, call.page_size,
                                  call.num_q_heads, call.num_kv_heads, has_sinks=call.has_sinks) is None
    return unsupported(call.dtype, call.kv_dtype, call.kv_dtype, call.head_dim, call.head_dim_v,
                       call.page_size, packed_group=pack_for(call.group, call.max_q_len)) is None


def triton_launchable(call: Call) -> bool:
    """Whether torch launches the Triton-lowered kernel for this call (``torch_bridge.triton_path``)."""
    from jax_attn.kernels.triton_paged import unsupported

    return unsupported(call.dtype, call.head_dim, call.head_dim_v, latent=call.latent) is None


def packed_sinks_wanted(call: Call) -> bool:
    """False for decode and verify rows that pack a group's query heads and carry sinks (gpt-oss): the Mosaic
    kernel takes them (each row its query head's sink) but was slower than Triton on an H200 (64/8 heads,
    d 64, page 16, 2026-11-28, benchmarks/RESULTS.md): decode 64 x 4096 3.24 against 4.06 TB/s, 8 x 8192
    2.05 against 3.08. Prefill rows (one head each) always pass."""
    from jax_attn.kernels.mosaic_paged import DEFAULT_MOSAIC_CONFIG as config

    return not call.has_sinks or call.max_q_len > config.pack_max_q_len


VARLEN_PAGE = 64  # the page size varlen keys are copied into for the Mosaic kernel (``varlen_repaged``)


def varlen_repaged(impl: str, call: Call) -> bool:
    """Whether a varlen call (``attention.varlen_attention``: keys in contiguous ragged runs; ``call`` its
    view as pages of one row) copies its keys into pages of
    ``VARLEN_PAGE`` rows first (``attention.varlen_pages``: one read and one write of K/V), to run on the Mosaic
    kernel's TMA copies. Only where this policy picks Mosaic for the call at that page size, for long query
    runs (prefill), and where the rows of one-row pages cannot be gathered (head dims that are not multiples of
    64, e.g. 96). Elsewhere the gathered rows are faster than the copy: on an H200 (B4, 16 heads, bf16,
    ``benchmarks/bench_mla.py --prefix-mha``, 2026-11-29, thirty-first session), gathered against copied,
    TFLOP/s: causal S4096 at 192/128 499 against 460, at 128/128 534 against 500; a prefix chunk of 1024 queries
    on 4096 keys at 192/128 514 against 513."""
    from jax_attn.kernels.mosaic_paged import DEFAULT_MOSAIC_CONFIG as config

    if call.max_q_len <= config.pack_max_q_len:
        return False
    if select_kernel(impl, dataclasses.replace(call, page_size=VARLEN_PAGE)) != "mosaic":
        return False
    return not mosaic_covers(call)  # (``call``: pages of one row, gathered)


def select_kernel(impl: str, call: Call, *, from_torch: bool = False, hopper: bool = True) -> str:
    """The kernel a call runs with: ``"mosaic"``, ``"triton"`` or ``"reference"``. ``from_torch``: the
    kernel torch launches, ``"mosaic"`` (where ``hopper``) or ``"triton"``, else ``"jax"`` (a compiled JAX
    executable)."""
    impl = resolve_impl(impl)
    if from_torch:
        speed = impl == "mosaic" or (gathered_rows_wanted(call) and packed_sinks_wanted(call)
                                     and packed_rows_wanted(call))
        if impl in ("auto", "mosaic") and hopper and speed and mosaic_covers(call):
            return "mosaic"
        return "triton" if impl in ("auto", "triton") and triton_launchable(call) else "jax"
    if impl != "auto":
        return impl
    return "mosaic" if mosaic_wanted(call) and mosaic_covers(call) else "triton"

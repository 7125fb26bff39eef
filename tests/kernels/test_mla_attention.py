"""MLA attention kernels against their torch references (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from triton.runtime.errors import OutOfResources

from kernels import mla_attention as mla
from tests.fixtures.triton_interpret import kernel_device

DEVICE = kernel_device()
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
# bf16 loads are wrong in the interpreter: bf16 runs on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def paged_cache(context_lens, page_size, width, dtype, seed):
    """A pool with sequences on shuffled pages, plus their page table."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in context_lens]
    total = sum(pages_per_seq) + 3
    pool = torch.randn(total, page_size, width, generator=g).to(dtype)
    order = torch.randperm(total, generator=g).tolist()
    table = torch.zeros(len(context_lens), max(pages_per_seq), dtype=torch.int32)
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    return pool, table


# (heads, latent C, rope R, page size, context lens, splits)
CASES = [
    (4, 32, 8, 4, [1, 5, 37], 1),
    (4, 32, 8, 4, [1, 5, 37], 3),  # the 1-token sequence leaves splits empty
    (20, 64, 16, 16, [70, 3], 2),  # two head blocks, the second partial
    (16, 48, 8, 8, [129], 4),  # latent width not a power of two
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,latent,rope,page_size,lens,splits", CASES)
def test_mla_decode_matches_ref(dtype, heads, latent, rope, page_size, lens, splits):
    g = torch.Generator().manual_seed(heads + latent)
    batch = len(lens)
    pool, table = paged_cache(lens, page_size, latent + rope, dtype, seed=latent)
    q_lat = torch.randn(batch, heads, latent, generator=g).to(dtype)
    q_rope = torch.randn(batch, heads, rope, generator=g).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    scale = (latent + rope) ** -0.5
    args = [t.to(DEVICE) for t in (q_lat, q_rope, pool, table, ctx)]
    ours = mla.mla_decode(*args, scale, num_splits=splits, variant="v2")
    ref = mla.mla_decode_ref(q_lat.float(), q_rope.float(), pool.float(), table, ctx, scale)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(ours.float().cpu(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("config", range(len(mla.MLA_DECODE_CONFIGS)))
def test_each_raced_config_matches_ref(config):
    """Wider head/token tiles than the head count or context, partial tiles included."""
    heads, latent, rope, page_size, lens = 20, 64, 16, 16, [70, 3, 130]
    g = torch.Generator().manual_seed(config)
    pool, table = paged_cache(lens, page_size, latent + rope, torch.float32, seed=config)
    q_lat = torch.randn(len(lens), heads, latent, generator=g)
    q_rope = torch.randn(len(lens), heads, rope, generator=g)
    ctx = torch.tensor(lens, dtype=torch.int32)
    args = [t.to(DEVICE) for t in (q_lat, q_rope, pool, table, ctx)]
    ours = mla.mla_decode(
        *args, 0.1, num_splits=2, config=mla.MLA_DECODE_CONFIGS[config], variant="v2"
    )
    ref = mla.mla_decode_ref(q_lat, q_rope, pool, table, ctx, 0.1)
    torch.testing.assert_close(ours.cpu(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("lens", [[1], [300, 17, 64, 1025, 2, 513, 700, 31]])
def test_tuned_mla_decode_matches_ref_on_gpu(heads, lens):
    """Every raced configuration is right (DeepSeek shapes, bf16), and so is the race."""
    latent, rope, page_size = 512, 64, 16
    g = torch.Generator().manual_seed(heads + len(lens))
    pool, table = paged_cache(lens, page_size, latent + rope, torch.bfloat16, seed=heads)
    q_lat = torch.randn(len(lens), heads, latent, generator=g).to(torch.bfloat16)
    q_rope = torch.randn(len(lens), heads, rope, generator=g).to(torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32)
    scale = (128 + rope) ** -0.5
    ref = mla.mla_decode_ref(q_lat.float(), q_rope.float(), pool.float(), table, ctx, scale)
    args = [t.cuda() for t in (q_lat, q_rope, pool, table, ctx)]
    for config in mla.MLA_DECODE_CONFIGS:
        if config.kwargs["BLOCK_H"] > max(16, heads):
            continue
        try:
            ours = mla.mla_decode(*args, scale, config=config, variant="v2")
        except OutOfResources:  # the race skips such configs the same way; v1's must fit
            assert config is not mla.MLA_DECODE_CONFIGS[0]
            continue
        torch.testing.assert_close(ours.float().cpu(), ref, atol=2e-2, rtol=2e-2, msg=str(config))
    ours = mla.mla_decode(*args, scale, variant="v2")  # the raced choice
    torch.testing.assert_close(ours.float().cpu(), ref, atol=2e-2, rtol=2e-2)


def test_absorbed_decode_equals_naive_attention():
    """The absorbed reference equals attention over K/V expanded through kv_b."""
    g = torch.Generator().manual_seed(0)
    heads, latent, rope, nope, v_dim, ctx_len, page_size = 3, 16, 8, 12, 10, 11, 4
    pool, table = paged_cache([ctx_len], page_size, latent + rope, torch.float64, seed=1)
    w_uk = torch.randn(heads, nope, latent, generator=g, dtype=torch.float64)
    w_uv = torch.randn(heads, v_dim, latent, generator=g, dtype=torch.float64)
    q_nope = torch.randn(1, heads, nope, generator=g, dtype=torch.float64)
    q_rope = torch.randn(1, heads, rope, generator=g, dtype=torch.float64)
    scale = (nope + rope) ** -0.5
    q_lat = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
    o_lat = mla.mla_decode_ref(q_lat, q_rope, pool, table, torch.tensor([ctx_len]), scale)
    absorbed = torch.einsum("bhc,hvc->bhv", o_lat, w_uv)[0]

    rows = mla.gather_paged_rows(pool, table[0], ctx_len)
    latent_rows, k_rope = rows[:, :latent], rows[:, latent:]
    k = torch.cat(
        [torch.einsum("tc,hnc->thn", latent_rows, w_uk), k_rope[:, None].expand(-1, heads, -1)], -1
    )
    v = torch.einsum("tc,hvc->thv", latent_rows, w_uv)
    q = torch.cat([q_nope, q_rope], dim=-1)
    naive = mla.mla_prefill_ref(q, k, v, scale, offset=ctx_len - 1)[0]
    # The references compute in float32, so agreement is to float32 rounding.
    torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=1e-5)


def test_prefill_ref_is_causal():
    """Changing a later key/value must not change earlier queries' outputs."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(6, 2, 8, generator=g) for _ in range(3))
    before = mla.mla_prefill_ref(q, k, v, 0.3, offset=0)
    k[4:], v[4:] = 0.0, 5.0
    after = mla.mla_prefill_ref(q, k, v, 0.3, offset=0)
    torch.testing.assert_close(before[:4], after[:4])
    assert not torch.allclose(before[4:], after[4:])

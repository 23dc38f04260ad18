"""The Triton kernels of :mod:`rlcli.ops.dsa_triton` (imported on first use: Triton reads
``TRITON_INTERPRET`` once, when it is first imported). The number of chosen tokens ``K`` and the
scores' query and key counts ``T`` and ``S`` (with the row strides that follow them) are runtime
arguments Triton does not specialize on: one kernel serves every prompt length (a prompt shorter
than ``index_topk`` chooses all its tokens)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T", "S", "sk_t", "so_t"])
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, out_ptr, T, S, scale, sq_t, sq_h, sw_t, sk_t, sk_s, so_t,
                         HI: tl.constexpr, DI: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr,
                         BT: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr):
    # ROWS queries per program (BT-row blocks, padded): BT for shared keys (sk_t = 0), 1 for
    # per-query keys. Key blocks vary fastest, so programs running together share their queries.
    pid_s, pid_t = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # offsets pass 2**31
    i = tl.arange(0, BT)
    t = pid_t * ROWS + i
    s = pid_s * BS + tl.arange(0, BS)
    d = tl.arange(0, DP)
    mt, ms, md = (t < T) & (i < ROWS), s < S, d < DI
    k = tl.load(k_ptr + pid_t * sk_t + s[:, None] * sk_s + d[None, :], mask=ms[:, None] & md[None, :], other=0.0)
    kt = tl.trans(k)
    acc = tl.zeros([BT, BS], dtype=tl.float32)
    for h in range(HI):
        q = tl.load(q_ptr + t[:, None] * sq_t + h * sq_h + d[None, :], mask=mt[:, None] & md[None, :], other=0.0)
        w = tl.load(w_ptr + t * sw_t + h, mask=mt, other=0.0)
        x = tl.dot(q, kt, input_precision=PREC) * scale
        acc += w[:, None] * tl.maximum(x, 0.0)
    tl.store(out_ptr + t[:, None] * so_t + s[None, :], acc, mask=mt[:, None] & ms[None, :])


@triton.jit(do_not_specialize=["S", "st_t", "so_t"])
def _paged_index_scores_kernel(q_ptr, w_ptr, k_ptr, tables_ptr, lens_ptr, out_ptr, S, scale, sq_t, sq_h, sw_t, sk_s,
                               st_t, so_t, HI: tl.constexpr, DI: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr,
                               BS: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr):
    # One decoding sequence t per program column, BS of its positions per program: each position's
    # key is read from the paged index cache at its slot (the block table's block, the offset in it),
    # scored as _index_scores_kernel scores a per-query key (the query in row 0 of a BT-row dot);
    # positions at or past the sequence's context length score -inf, and blocks wholly past it read nothing.
    pid_s, t = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    n = tl.load(lens_ptr + t)
    s = pid_s * BS + tl.arange(0, BS)
    ms = s < n
    acc = tl.zeros([BT, BS], dtype=tl.float32)
    if pid_s * BS < n:
        i = tl.arange(0, BT)
        d = tl.arange(0, DP)
        mt, md = i < 1, d < DI
        blk = tl.load(tables_ptr + t * st_t + s // BLOCK, mask=ms, other=0)
        slot = blk.to(tl.int64) * BLOCK + s % BLOCK
        k = tl.load(k_ptr + slot[:, None] * sk_s + d[None, :], mask=ms[:, None] & md[None, :], other=0.0)
        kt = tl.trans(k)
        for h in range(HI):
            q = tl.load(q_ptr + t * sq_t + h * sq_h + i[:, None] * 0 + d[None, :], mask=mt[:, None] & md[None, :],
                        other=0.0)
            w = tl.load(w_ptr + t * sw_t + h + i * 0, mask=mt, other=0.0)
            x = tl.dot(q, kt, input_precision=PREC) * scale
            acc += w[:, None] * tl.maximum(x, 0.0)
    row = tl.sum(acc, axis=0)  # rows past the first are zeros
    tl.store(out_ptr + t * so_t + s, tl.where(ms, row, float("-inf")), mask=s < S)


@triton.jit(do_not_specialize=["K", "si_t"])
def _sparse_fwd_kernel(q_ptr, kv_ptr, idx_ptr, count_ptr, o_ptr, lse_ptr, scale, H, K, sq_t, sq_h,
                       skv_s, si_t, so_t, so_h, HB: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, DR: tl.constexpr,
                       DRP: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, COUNTS: tl.constexpr):
    # COUNTS: a query's entries past count_ptr[t] are all invalid (the engine's decodes: valid first),
    # so its loop stops there; an invalid block would add nothing (p = 0, alpha = 1) anyway.
    t, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    h = hb * HB + tl.arange(0, HB)
    mh = h < H
    r, d = tl.arange(0, RP), tl.arange(0, DRP)
    mr, md = r < R, d < DR
    q_base = q_ptr + t * sq_t + h[:, None] * sq_h
    q_lat = tl.load(q_base + r[None, :], mask=mh[:, None] & mr[None, :], other=0.0)
    q_rot = tl.load(q_base + R + d[None, :], mask=mh[:, None] & md[None, :], other=0.0)
    m = tl.full([HB], float("-inf"), dtype=tl.float32)
    l = tl.zeros([HB], dtype=tl.float32)
    acc = tl.zeros([HB, RP], dtype=tl.float32)
    if COUNTS:
        n = tl.minimum(tl.load(count_ptr + t), K)
    else:
        n = K
    for j in range(0, n, BK):
        jj = j + tl.arange(0, BK)
        ids = tl.load(idx_ptr + t * si_t + jj, mask=jj < K, other=-1)
        ok = ids >= 0
        row = kv_ptr + tl.where(ok, ids, 0).to(tl.int64)[:, None] * skv_s
        kl = tl.load(row + r[None, :], mask=ok[:, None] & mr[None, :], other=0.0)
        kr = tl.load(row + R + d[None, :], mask=ok[:, None] & md[None, :], other=0.0)
        x = tl.dot(q_lat, tl.trans(kl), input_precision=PREC)
        x = (x + tl.dot(q_rot, tl.trans(kr), input_precision=PREC)) * scale
        x = tl.where(ok[None, :], x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(x - m_use[:, None])
        alpha = tl.exp(m - m_use)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kl.dtype), kl, input_precision=PREC)
        m = m_new
    o = acc / l[:, None]
    tl.store(o_ptr + t * so_t + h[:, None] * so_h + r[None, :], o.to(o_ptr.dtype.element_ty),
             mask=mh[:, None] & mr[None, :])
    tl.store(lse_ptr + t * H + h, m + tl.log(l), mask=mh)


@triton.jit(do_not_specialize=["K", "si_t"])
def _sparse_bwd_kernel(q_ptr, kv_ptr, idx_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr, dkv_ptr, scale, H,
                       K, sq_t, sq_h, skv_s, si_t, so_t, so_h, HB: tl.constexpr, R: tl.constexpr,
                       RP: tl.constexpr, DR: tl.constexpr, DRP: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    t, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    h = hb * HB + tl.arange(0, HB)
    mh = h < H
    r, d = tl.arange(0, RP), tl.arange(0, DRP)
    mr, md = r < R, d < DR
    q_base = q_ptr + t * sq_t + h[:, None] * sq_h
    q_lat = tl.load(q_base + r[None, :], mask=mh[:, None] & mr[None, :], other=0.0)
    q_rot = tl.load(q_base + R + d[None, :], mask=mh[:, None] & md[None, :], other=0.0)
    o_off = t * so_t + h[:, None] * so_h + r[None, :]
    mo = mh[:, None] & mr[None, :]
    do = tl.load(do_ptr + o_off, mask=mo, other=0.0)
    delta = tl.sum(tl.load(o_ptr + o_off, mask=mo, other=0.0).to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(lse_ptr + t * H + h, mask=mh, other=0.0)
    do = do.to(q_lat.dtype)
    dq_lat = tl.zeros([HB, RP], dtype=tl.float32)
    dq_rot = tl.zeros([HB, DRP], dtype=tl.float32)
    for j in range(0, K, BK):
        jj = j + tl.arange(0, BK)
        ids = tl.load(idx_ptr + t * si_t + jj, mask=jj < K, other=-1)
        ok = ids >= 0
        safe = tl.where(ok, ids, 0).to(tl.int64)[:, None]
        row = kv_ptr + safe * skv_s
        kl = tl.load(row + r[None, :], mask=ok[:, None] & mr[None, :], other=0.0)
        kr = tl.load(row + R + d[None, :], mask=ok[:, None] & md[None, :], other=0.0)
        x = tl.dot(q_lat, tl.trans(kl), input_precision=PREC)
        x = (x + tl.dot(q_rot, tl.trans(kr), input_precision=PREC)) * scale
        p = tl.where(ok[None, :] & mh[:, None], tl.exp(x - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(kl), input_precision=PREC)
        ds = (p * (dp - delta[:, None]) * scale).to(kl.dtype)
        dq_lat += tl.dot(ds, kl, input_precision=PREC)
        dq_rot += tl.dot(ds, kr, input_precision=PREC)
        dsT = tl.trans(ds)
        dkl = tl.dot(tl.trans(p.to(kl.dtype)), do, input_precision=PREC)
        dkl += tl.dot(dsT, q_lat, input_precision=PREC)
        dkr = tl.dot(dsT, q_rot, input_precision=PREC)
        drow = dkv_ptr + safe * (R + DR)
        tl.atomic_add(drow + r[None, :], dkl, mask=ok[:, None] & mr[None, :])
        tl.atomic_add(drow + R + d[None, :], dkr, mask=ok[:, None] & md[None, :])
    dq_base = dq_ptr + t * sq_t + h[:, None] * sq_h
    tl.store(dq_base + r[None, :], dq_lat.to(dq_ptr.dtype.element_ty), mask=mh[:, None] & mr[None, :])
    tl.store(dq_base + R + d[None, :], dq_rot.to(dq_ptr.dtype.element_ty), mask=mh[:, None] & md[None, :])


@triton.jit
def _order_key(x):
    """fp32 -> uint32 whose unsigned order is the floats' (-0.0 made +0.0, so the two tie)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    return tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)


@triton.jit(do_not_specialize=["K", "ss_t", "so_t"])
def _topk_rows_kernel(s_ptr, lens_ptr, out_ptr, K, ss_t, so_t, CHUNK: tl.constexpr):
    # One row per program, reading only its first lens[t] scores: the k-th largest key by radix
    # select (4 rounds of 8 bits, a histogram of the digits among the keys whose higher digits
    # match so far), then one pass listing every larger key and the earliest keys equal to it, in
    # position order (running counts carried across chunks).
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + t)
    c = tl.arange(0, CHUNK)
    if n <= K:  # the whole context, then positions past it (the caller's invalid entries)
        for c0 in range(0, K, CHUNK):
            tl.store(out_ptr + t * so_t + c0 + c, (c0 + c).to(tl.int64), mask=c0 + c < K)
    else:
        bins = tl.arange(0, 256)
        prefix = tl.full([], 0, tl.uint32)
        need = K
        for r in tl.static_range(4):
            shift = 24 - 8 * r
            hist = tl.zeros([256], dtype=tl.int32)
            for c0 in range(0, n, CHUNK):
                pos = c0 + c
                m = pos < n
                key = _order_key(tl.load(s_ptr + t * ss_t + pos, mask=m, other=0.0))
                if r > 0:
                    m = m & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
                hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=m)
            at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys whose digit is >= the bin's
            d = tl.sum((at_least >= need).to(tl.int32), 0) - 1
            need -= tl.sum(tl.where(bins == d, at_least - hist, 0), 0)  # less those above the digit
            prefix = prefix | (d.to(tl.uint32) << shift)
        taken = 0
        ties = 0
        for c0 in range(0, n, CHUNK):
            pos = c0 + c
            m = pos < n
            key = _order_key(tl.load(s_ptr + t * ss_t + pos, mask=m, other=0.0))
            eq = (m & (key == prefix)).to(tl.int32)
            take = ((m & (key > prefix)) | ((eq == 1) & (ties + tl.cumsum(eq, 0) - eq < need))).to(tl.int32)
            tl.store(out_ptr + t * so_t + taken + tl.cumsum(take, 0) - take, pos.to(tl.int64), mask=take == 1)
            taken += tl.sum(take, 0)
            ties += tl.sum(eq, 0)

"""An element-by-element implementation of docs/design.md in plain Python floats.

Deliberately shares no code with atom_backend.reference: it loops over sequences, heads,
queries and keys, and evaluates each rule with `math`, so the vectorised reference can be
checked against it on small random cases.
"""

from __future__ import annotations

import math


def visible(i_abs: int, j: int, causal: bool, window: int, sink_tokens: int) -> bool:
    if causal and j > i_abs:
        return False
    if window > 0 and not j > i_abs - window:
        return sink_tokens > 0 and j < sink_tokens
    return True


def attend_row(qv, keys, values, positions, i_abs, *, scale, causal, window, sink_tokens, softcap):
    """(o, lse) of one query row against (key, value, position) triples; no sinks."""
    xs, vs = [], []
    for kv, vv, j in zip(keys, values, positions):
        if not visible(i_abs, j, causal, window, sink_tokens):
            continue
        x = scale * sum(a * b for a, b in zip(qv, kv))
        if softcap > 0:
            x = softcap * math.tanh(x / softcap)
        xs.append(x)
        vs.append(vv)
    d = len(qv)
    if not xs:
        return [0.0] * d, -math.inf
    m = max(xs)
    ws = [math.exp(x - m) for x in xs]
    denom = sum(ws)
    o = [sum(w * v[c] for w, v in zip(ws, vs)) / denom for c in range(d)]
    return o, m + math.log(denom)


def varlen(q, k, v, cu_q, cu_k, *, scale=None, causal=True, window=0, sink_tokens=0, sinks=None, softcap=0.0):
    """q: nested lists [total_q][hq][d]; returns (o [total_q][hq][d], lse [total_q][hq])."""
    hq, hk, d = len(q[0]) if q else 0, len(k[0]) if k else 1, len(q[0][0]) if q else 0
    scale = 1.0 / math.sqrt(d) if scale is None and d else scale
    o = [[None] * hq for _ in q]
    lse = [[None] * hq for _ in q]
    for b in range(len(cu_q) - 1):
        sq, sk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        for h in range(hq):
            g = h // (hq // hk)
            keys = [k[cu_k[b] + j][g] for j in range(sk)]
            vals = [v[cu_k[b] + j][g] for j in range(sk)]
            for i in range(sq):
                t = cu_q[b] + i
                row, l = attend_row(
                    q[t][h], keys, vals, range(sk), sk - sq + i,
                    scale=scale, causal=causal, window=window, sink_tokens=sink_tokens, softcap=softcap,
                )
                if sinks is not None:
                    s = sinks[h]
                    # exp(s - m) joins the denominator: o_i * Z / (Z + e^s) with Z = e^lse
                    w = 0.0 if l == -math.inf else 1.0 / (1.0 + math.exp(s - l))
                    row = [c * w for c in row]
                o[t][h], lse[t][h] = row, l
    return o, lse


def gather(cache, pages, seq_len, page_size, descale=None, scale=None):
    """Token rows of one sequence from a paged cache given as nested lists [blk][slot][g][d]."""
    rows = []
    for t in range(seq_len):
        p = pages[t // page_size]
        row = cache[p][t % page_size]
        if descale is not None:
            row = [[x * descale[p][g] for x in row[g]] for g in range(len(row))]
        elif scale is not None:
            row = [[x * scale for x in r] for r in row]
        rows.append(row)
    return rows

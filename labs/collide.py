"""Lab: block-hash collisions, by chance and by construction, with and without verify-on-hit.

With ``hash="trunc:N"`` (the top N bits of SHA-256):

1. **offline birthday count**: hash many random first blocks with the engine's own
   ``BlockHasher`` (same seed, same extra keys) and count colliding pairs;
2. **through the engine**: send random one-block prompts one after another (verify-on-hit on)
   and count the requests whose first block met a different block with the same hash, seen as
   ``CollisionCaught`` events; compare with what the offline hashes of the same prompts predict;
3. **crafted pair**: search offline for two prompts that differ only in a secret code whose
   block hashes collide; alice sends hers, then bob sends his. With verify-on-hit off, bob's
   request is served alice's KV (cached tokens from alice) and answers from it; with it on the
   collision is caught, the block recomputed, and bob's answer equals his cold answer.

Every count is compared with the birthday bound: expected pairs ≈ n²/2^(N+1).
"""
from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import dataclass

from kvplay.engine import events as ev
from kvplay.engine.prefix import BlockHasher, block_extras
from kvplay.engine.sampling_params import SamplingParams

from . import stats
from .common import LabContext, LabResult, Table, cached_cell, pyplot, quoted, token_messages, token_pool

TEMPLATE = "{pad}Remember this: my locker code is {code}.\nWhat is my locker code? Reply with the code only."
DIGITS = 8
SCALES = [1e6, 1e9, 1e12]


@dataclass
class CollideParams:
    bits: int = 16
    feed: int = 400  # random one-block prompts sent through the engine
    offline: int = 20000  # random first blocks hashed offline for the birthday count
    max_tries: int = 2_000_000  # budget of the crafted-pair search
    max_tokens: int = 16
    seed: int = 0


def expected_pairs(n: float, bits: int) -> float:
    return n * (n - 1) / 2 ** (bits + 1) if n >= 1 else 0.0


def expected_repeats(n: int, bits: int) -> float:
    """Expected requests (of n) whose hash was already taken: n minus the expected distinct values."""
    m = 2.0 ** bits
    return n - m * -math.expm1(n * math.log1p(-1 / m)) if bits < 1000 else 0.0


def p_any(n: float, bits: int) -> float:
    """Birthday bound: P(at least one colliding pair among n random values of `bits` bits)."""
    return -math.expm1(-expected_pairs(n, bits))


def _hasher_and_extras(eng, n_blocks: int, user: str = "u"):
    cfg = eng.config
    hasher = BlockHasher(cfg.hash, cfg.block_size, cfg.hash_seed)
    extras = block_extras(cfg.isolation, user, None, eng.model_name, n_blocks, 0, cfg.block_size)
    return hasher, extras


def offline_birthday(eng, n: int, rng: random.Random) -> dict:
    hasher, extras = _hasher_and_extras(eng, 1)
    vocab, bs = token_pool(eng.tokenizer), eng.config.block_size
    counts = Counter(hasher.block_hash(None, [rng.choice(vocab) for _ in range(bs)], extras[0]) for _ in range(n))
    pairs = sum(c * (c - 1) // 2 for c in counts.values())
    return {"n": n, "pairs": pairs, "expected": expected_pairs(n, hasher.fn.bits)}


def engine_feed(eng, ctx: LabContext, n: int, rng: random.Random) -> dict:
    """Random one-block prompts, sequentially, verify-on-hit on: every collision must be caught."""
    hasher, extras = _hasher_and_extras(eng, 1)
    vocab, bs = token_pool(eng.tokenizer), eng.config.block_size
    caught: list = []
    unsub = eng.subscribe_batches(lambda b: caught.extend(e for e in b.events if isinstance(e, ev.CollisionCaught)))
    seen: dict[int, tuple] = {}
    predicted, first_at, false_hits = 0, None, 0
    sampling = SamplingParams(max_tokens=1, stop_on_eos=False)
    ctx.phase(f"feeding {n} random prompts", n)
    try:
        for i in range(n):
            ids = [rng.choice(vocab) for _ in range(bs + 1)]
            h = hasher.block_hash(None, ids[:bs], extras[0])
            if h in seen and seen[h] != tuple(ids[:bs]):
                predicted += 1
                first_at = first_at if first_at is not None else i + 1
            seen.setdefault(h, tuple(ids[:bs]))
            res = eng.submit(f"u{i % 7}", prompt_ids=ids, sampling=sampling).result(600)
            ctx.record(f"u{i % 7}", token_messages(eng.tokenizer, ids), sampling, res)
            false_hits += res.stats.cached_tokens > 0
            ctx.advance()
        eng.call(lambda: None)  # the last step's batch is handed over (a result comes before its step ends)
    finally:
        unsub()
    return {"n": n, "predicted": predicted, "caught": len(caught), "false_hits": false_hits,
            "first_collision_at": first_at, "expected": expected_repeats(n, hasher.fn.bits),
            "evictions": eng.stats()["evictions"]}


def _digit_layout(eng, pad: str):
    """(ids of the prompt with code 0…0, positions of the code's tokens, token id of each digit)."""
    enc = lambda code: eng.encode([{"role": "user", "content": TEMPLATE.format(pad=pad, code=code)}])[0]  # noqa: E731
    base = enc("0" * DIGITS)
    digit_ids = []
    for d in range(10):
        other = enc(str(d) * DIGITS)
        if len(other) != len(base):
            return None
        pos = [i for i, (a, b) in enumerate(zip(base, other)) if a != b]
        digit_ids.append(other[pos[0]] if pos else None)
    pos = [i for i, (a, b) in enumerate(zip(base, enc("1" * DIGITS))) if a != b]
    if len(pos) != DIGITS or pos[-1] - pos[0] != DIGITS - 1 or digit_ids[0] is not None:
        return None
    digit_ids[0] = base[pos[0]]
    return base, pos, digit_ids


def craft_pair(eng, params: CollideParams, rng: random.Random) -> dict | None:
    """Two prompts, different codes, whose code block has the same chained hash."""
    bs = eng.config.block_size
    layout = None
    for j in range(bs):
        layout = _digit_layout(eng, "Note. " * j)
        if layout and layout[1][0] // bs == layout[1][-1] // bs:
            pad = "Note. " * j
            break
    else:
        return None
    base, pos, digit_ids = layout
    blk = pos[0] // bs
    hasher, extras = _hasher_and_extras(eng, blk + 1, "alice")
    parent = hasher.chain(base[:blk * bs], extras)[-1] if blk else None
    block = list(base[blk * bs:(blk + 1) * bs])
    offs = [p - blk * bs for p in pos]
    seen: dict[int, str] = {}
    for tries in range(1, params.max_tries + 1):
        code = "".join(rng.choice("0123456789") for _ in range(DIGITS))
        for o, ch in zip(offs, code):
            block[o] = digit_ids[int(ch)]
        h = hasher.block_hash(parent, block, extras[blk])
        if h in seen and seen[h] != code:
            a, b = seen[h], code
            def with_code(c: str) -> list[int]:
                ids = list(base)
                for i, ch in zip(pos, c):
                    ids[i] = digit_ids[int(ch)]
                return ids

            text_a = TEMPLATE.format(pad=pad, code=a)
            return {"code_a": a, "code_b": b, "ids_a": with_code(a), "ids_b": with_code(b), "block": blk,
                    "tries": tries, "hash": hasher.hex(h), "text_a": text_a,
                    "tokenization_matches": eng.encode([{"role": "user", "content": text_a}])[0] == with_code(a),
                    "text_b": TEMPLATE.format(pad=pad, code=b)}
        seen[h] = code
    return {"tries": params.max_tries, "found": False}


def _demo(eng, ctx, pair: dict, verify: bool, max_tokens: int) -> dict:
    eng.reconfigure(verify_on_hit=verify)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    caught: list = []
    unsub = eng.subscribe_batches(lambda b: caught.extend(e for e in b.events if isinstance(e, ev.CollisionCaught)))
    try:
        eng.clear_cache()
        ra = eng.submit("alice", prompt_ids=pair["ids_a"], sampling=sampling).result(600)
        rb = eng.submit("bob", prompt_ids=pair["ids_b"], sampling=sampling).result(600)
        eng.call(lambda: None)  # the last step's batch is handed over (a result comes before its step ends)
    finally:
        unsub()
    ctx.record("alice", [{"role": "user", "content": pair["text_a"]}], sampling, ra)
    ctx.record("bob", [{"role": "user", "content": pair["text_b"]}], sampling, rb)
    return {"verify_on_hit": verify, "alice_answer": ra.text, "bob_answer": rb.text,
            "bob_cached_tokens": rb.stats.cached_tokens, "bob_cached_from": rb.stats.cached_from,
            "bob_prompt_tokens": rb.stats.prompt_tokens, "collisions_caught": len(caught)}


def run(eng, params: CollideParams | None = None, ctx: LabContext | None = None) -> LabResult:
    p = params or CollideParams()
    ctx = ctx or LabContext()
    t_start = time.perf_counter()
    rng = random.Random(p.seed)
    old = {k: getattr(eng.config, k) for k in ("hash", "verify_on_hit", "isolation")}
    eng.reconfigure(hash=f"trunc:{p.bits}", verify_on_hit=True, isolation="shared")  # clears the cache
    offline = offline_birthday(eng, p.offline, rng)
    feed = engine_feed(eng, ctx, p.feed, rng)
    ctx.phase("crafting a colliding pair", 1)
    pair = craft_pair(eng, p, rng)
    ctx.advance()
    demos = []
    if pair and pair.get("code_a"):
        sampling = SamplingParams(max_tokens=p.max_tokens, temperature=0.0)
        eng.clear_cache()
        cold_b = eng.submit("bob", prompt_ids=pair["ids_b"], sampling=sampling).result(600)
        ctx.record("bob", [{"role": "user", "content": pair["text_b"]}], sampling, cold_b)
        pair["bob_cold_answer"] = cold_b.text
        for verify in (False, True):
            d = _demo(eng, ctx, pair, verify, p.max_tokens)
            d["bob_correct"] = d["bob_answer"] == cold_b.text
            demos.append(d)
    eng.reconfigure(**old)
    ctx.progress.close()
    for d, k in ((offline, "pairs"), (feed, "predicted")):
        d["ci"] = stats.poisson_ci(d[k])  # the count's mean, 95 %: does the birthday bound lie in it?
        d["bound_in_ci"] = d["ci"][0] <= d["expected"] <= d["ci"][1]
    feed["caught_ci"] = stats.clopper_pearson(feed["caught"], feed["predicted"])
    feed["false_hit_ci"] = stats.clopper_pearson(feed["false_hits"], feed["n"])
    scale = [[bits, f"{n:.0e}", expected_pairs(n, bits), p_any(n, bits)]
             for bits in (p.bits, 64, 256) for n in SCALES]
    tables = [
        Table(f"Birthday check at trunc:{p.bits}",
              ["experiment", "blocks n", "collisions measured", "95 % CI (Poisson)", "expected (birthday)",
               "bound in CI", "caught by verify-on-hit"],
              [["offline: colliding pairs, random blocks", offline["n"], offline["pairs"], _ci(offline["ci"]),
                offline["expected"], offline["bound_in_ci"], "—"],
               ["engine: requests whose block met another with its hash", feed["n"], feed["predicted"], _ci(feed["ci"]),
                feed["expected"], feed["bound_in_ci"],
                f"{stats.rate(feed['caught'], feed['predicted'])}; "
                f"false hits {stats.rate(feed['false_hits'], feed['n'])}"]]),
        Table("Birthday bound at realistic scales", ["bits", "blocks", "expected pairs", "P(≥1 collision)"], scale),
    ]
    if demos:
        tables.append(Table(
            f"Crafted collision (found after {pair['tries']} tries, block {pair['block']}, hash {pair['hash']}): "
            f"alice's code {pair['code_a']}, bob's code {pair['code_b']}",
            ["verify-on-hit", "bob cached tokens (from)", "collisions caught", "bob's answer", "bob's cold answer",
             "correct"],
            [[d["verify_on_hit"], cached_cell(d["bob_cached_tokens"], d["bob_prompt_tokens"], d["bob_cached_from"], "bob"),
              d["collisions_caught"], quoted(d["bob_answer"]), quoted(pair["bob_cold_answer"]), d["bob_correct"]]
             for d in demos]))
    data = {"params": p.__dict__, "offline": offline, "feed": feed, "pair": pair, "demos": demos,
            "scales": [dict(zip(["bits", "blocks", "expected_pairs", "p_any"], r)) for r in scale]}
    return LabResult("collide", _verdict(p, offline, feed, pair, demos), tables, data, eng.model_name,
                     eng.config.to_dict(), time.perf_counter() - t_start)


def _ci(ci: tuple[float, float]) -> str:
    return f"{ci[0]:.3g}–{ci[1]:.3g}"


def _fits(d: dict) -> str:
    return "the bound lies inside" if d["bound_in_ci"] else "the bound lies OUTSIDE"


def _verdict(p, offline, feed, pair, demos) -> str:
    s = (f"trunc:{p.bits}: {offline['pairs']} colliding pairs among {offline['n']} random blocks "
         f"(95 % CI of the mean {_ci(offline['ci'])}; birthday bound {offline['expected']:.3g}: {_fits(offline)}); "
         f"through the engine {feed['predicted']} of {feed['n']} random prompts collided (95 % CI {_ci(feed['ci'])}; "
         f"bound {feed['expected']:.3g}: {_fits(feed)}"
         + (f"; first at prompt {feed['first_collision_at']}" if feed["first_collision_at"] else "")
         + f") and verify-on-hit caught {stats.rate(feed['caught'], feed['predicted'])}, with false hits in "
           f"{stats.rate(feed['false_hits'], feed['n'])} requests. ")
    if demos:
        off = next(d for d in demos if not d["verify_on_hit"])
        on = next(d for d in demos if d["verify_on_hit"])
        s += (f"Crafted pair ({pair['tries']} tries): with verify-on-hit off bob was served "
              f"{off['bob_cached_tokens']} tokens of KV from {', '.join(sorted(off['bob_cached_from'])) or 'no one'} "
              f"and answered {quoted(off['bob_answer'])} (correct: {quoted(pair['bob_cold_answer'])}); with it on "
              "the collision was "
              f"{'caught' if on['collisions_caught'] else 'NOT caught'}, recomputed, and bob's answer "
              f"{'equals' if on['bob_correct'] else 'differs from'} his cold answer. ")
    elif pair:
        s += f"No crafted pair found in {pair['tries']} tries (expected ≈{1.18 * 2 ** (p.bits / 2):.3g}). "
    s += (f"By chance: 64-bit hashes reach P={p_any(1e9, 64):.2g} at 1e9 blocks and "
          f"{p_any(1e12, 64):.2g} at 1e12; SHA-256 stays at {p_any(1e12, 256):.1g}.")
    return s


def plot(result: LabResult, path: str) -> None:
    plt = pyplot()
    bits = result.data["params"]["bits"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ns = [10 ** (e / 4) for e in range(2, 57)]
    for b in sorted({bits, 32, 64, 128, 256}):
        ax.plot(ns, [max(expected_pairs(n, b), 1e-80) for n in ns], label=f"{b} bits: n²/2^(b+1)")
    off, feed = result.data["offline"], result.data["feed"]
    ax.scatter([off["n"], feed["n"]], [max(off["pairs"], 1e-80), max(feed["predicted"], 1e-80)],
               color="k", zorder=3, label=f"measured at {bits} bits")
    ax.axhline(1, color="grey", ls=":")
    ax.set(xscale="log", yscale="log", ylim=(1e-70, 1e30), xlabel="blocks n", ylabel="expected colliding pairs",
           title="birthday bound vs measured")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""The prefix tree (wire/tree.py) on a Mirror: structure against a brute-force reference built
from the same events, prediction, labels from a real tokenizer, and the local engine's events
through the one Mirror (wire/mirror.py)."""
from __future__ import annotations

import json

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from support.recorded import as_batches

from kvplay.engine.events import EngineBatch, decode_events
from kvplay.tui.tree_view import MirrorTrees
from kvplay.wire.codec import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvplay.wire.mirror import Mirror
from kvplay.wire.translate import FromWire
from kvplay.wire.tree import Labels, PrefixTree, to_json, to_text

BS = 2


def chain_hashes(tokens, bs=BS):
    """Content-addressed hashes: a block's hash names its whole prefix (like vLLM's)."""
    return [hash(tuple(tokens[:i + bs])) & 0xFFFFFFFF for i in range(0, len(tokens) - bs + 1, bs)]


def pod() -> FromWire:
    """A server's pod: a Mirror fed by its wire translator."""
    return FromWire(Mirror())


def feed(w: FromWire, batch: EventBatch) -> None:
    w.mirror.apply(w(batch))


def store(w: FromWire, tokens, user, ts=1.0):
    hs = chain_hashes(tokens)
    n = len(hs) * BS
    feed(w, EventBatch(ts, [BlockStored(hs, None, list(tokens[:n]), BS, session_id=user)]))
    return hs


# --- the brute-force reference ---------------------------------------------------------------------
def reference(blocks: dict):
    """Nodes as the partition of blocks by the set of cached sequences (root-to-leaf paths) through
    each, merged only along parent-child links; each node's parent node."""
    parent = {k: (b.parent if b.parent in blocks else None) for k, b in blocks.items()}
    has_child = {p for p in parent.values() if p is not None}
    leaves = [k for k in blocks if k not in has_child]
    through = {k: set() for k in blocks}
    for leaf in leaves:
        k = leaf
        while k is not None:
            through[k].add(leaf)
            k = parent[k]
    # union blocks with their parent when the same sequences pass through both
    group = {k: k for k in blocks}

    def find(k):
        while group[k] != k:
            k = group[k]
        return k

    for k, p in parent.items():
        if p is not None and through[p] == through[k]:
            group[find(k)] = find(p)
    nodes: dict = {}
    for k in blocks:
        nodes.setdefault(find(k), set()).add(k)
    first = {r: next(k for k in ks if parent[k] is None or parent[k] not in ks) for r, ks in nodes.items()}
    out = {}
    for r, ks in nodes.items():
        p = parent[first[r]]
        out[frozenset(ks)] = (None if p is None else frozenset(nodes[find(p)]), len(through[first[r]]))
    return out


def tree_shape(tree: PrefixTree):
    return {frozenset(n.keys): (None if n.parent is None else frozenset(n.parent.keys), n.sequences)
            for n in tree.nodes}


ops = st.lists(st.one_of(
    st.tuples(st.just("store"), st.integers(0, 3), st.lists(st.integers(0, 2), min_size=1, max_size=10)),
    st.tuples(st.just("remove"), st.integers(0, 10_000)),
    st.tuples(st.just("clear")),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_tree_matches_brute_force_reference(workload):
    w = pod()
    m = w.mirror
    users = ["alice", "bob", "carol", "dave"]
    prompts = []
    for op in workload:
        if op[0] == "store":
            toks = [9, 9, 9, 9] + op[2]  # a shared "system prompt" of two blocks, then a turn
            store(w, toks, users[op[1]])
            prompts.append(toks)
        elif op[0] == "remove" and m.blocks:
            keys = sorted(m.blocks)
            feed(w, EventBatch(2.0, [BlockRemoved([keys[op[1] % len(keys)]])]))  # any block, even mid-chain
        elif op[0] == "clear":
            feed(w, EventBatch(3.0, [AllBlocksCleared()]))
    tree = PrefixTree(m.blocks)
    assert tree_shape(tree) == reference(m.blocks)
    assert sum(len(n.keys) for n in tree.nodes) == len(m.blocks)
    assert sum(r.blocks_below for r in tree.roots) == len(m.blocks)
    for key in m.blocks:
        assert key in tree.node_of(key).keys
    # prediction: the longest cached chain from a true root, brute force
    for toks in prompts:
        want = 0
        for i, h in enumerate(chain_hashes(toks)):
            b = m.blocks.get(h)
            if b is None or (i == 0 and b.parent is not None) or b.tokens != toks[i * BS:(i + 1) * BS]:
                break
            if i and b.parent != chain_hashes(toks)[i - 1]:
                break
            want = (i + 1) * BS
        assert tree.match(toks) == want
        assert tree.predicted_hit(toks) == (want - BS if want and want >= len(toks) else want)


def test_shared_system_prompt_is_one_node_with_a_branch_per_conversation():
    w = pod()
    m = w.mirror
    system = [1, 2, 3, 4, 5, 6]
    store(w, system + [10, 11, 12, 13], "alice")
    store(w, system + [20, 21], "bob")
    store(w, system + [30, 31, 32, 33], "carol")
    store(w, system + [10, 11, 12, 13, 14, 15], "alice")  # alice's next turn extends her branch
    tree = PrefixTree(m.blocks)
    assert len(tree.roots) == 1
    root = tree.roots[0]
    assert len(root.keys) == 3 and root.tokens == 6 and root.creator == "alice"
    assert set(root.reusers) == {"bob", "carol"} and root.hits == 6  # 3 blocks, each reused twice
    assert sorted(len(c.keys) for c in root.children) == [1, 2, 3]
    assert root.children[0].creator == "alice" and root.children[0].blocks_below == 3
    assert root.sequences == 3 and root.blocks_below == 9
    lines = to_text(tree, Labels(None), now=1.0)
    assert lines[0] == "9 cached blocks in 4 nodes"
    assert lines[1].startswith('└─ "1 2 3 4 5 6" · 3 blk 6 tok · alice → bob, carol · 6 hits')
    assert len(lines) == 5


def test_siblings_beyond_the_limit_are_aggregated_and_deep_chains_do_not_recurse():
    w = pod()
    m = w.mirror
    for i in range(50):
        store(w, [7, 7, 100 + i, 0], f"u{i}")
    long = [5, 5] + list(range(20_000))
    store(w, long, "deep")
    tree = PrefixTree(m.blocks)
    big = next(r for r in tree.roots if r.blocks_below == 1 + 50)
    shown, more, blocks = tree.shown(big.children, 8)
    assert len(shown) == 8 and more == 42 and blocks == 42
    deep = next(r for r in tree.roots if r.creator == "deep")
    assert len(deep.keys) == len(long) // 2  # one node: a chain with no branch
    out = to_json(tree, Labels(None), limit=8, now=2.0)
    json.dumps(out)
    kids = next(r for r in out["roots"] if r["blocks_below"] == 51)["children"]
    assert kids[-1] == {"more": {"branches": 42, "blocks": 42}} and len(kids) == 9


def test_orphans_start_their_own_root():
    w = pod()
    m = w.mirror
    hs = store(w, [1, 1, 2, 2, 3, 3], "alice")
    feed(w, EventBatch(2.0, [BlockRemoved([hs[0]])]))
    tree = PrefixTree(m.blocks)
    assert len(tree.roots) == 1 and tree.roots[0].orphan and len(tree.roots[0].keys) == 2
    assert tree.match([1, 1, 2, 2, 3, 3]) == 0  # no true root: nothing a server would match


def test_labels_decode_with_the_tokenizer_bounded_and_cached(tiny_llama):
    tok = tiny_llama.tokenizer
    ids = tok("You are a careful assistant. Answer briefly.")["input_ids"]
    ids = ids[:len(ids) // BS * BS]
    w = pod()
    m = w.mirror
    store(w, ids, "alice")
    tree = PrefixTree(m.blocks)
    calls = []

    def detok(t):
        calls.append(list(t))
        return tok.decode(t)

    labels = Labels(detok)
    text = labels(tree, tree.roots[0])
    assert text == " ".join(tok.decode(ids[:48]).split()) + (" …" if len(ids) > 48 else "")
    assert labels(tree, tree.roots[0]) == text and len(calls) == 1  # cached
    assert all(len(c) <= 48 for c in calls)
    broken = Labels(lambda t: 1 / 0)  # a failing tokenizer: ids, not a crash
    assert broken(tree, tree.roots[0]).startswith(" ".join(map(str, ids[:3])))


def test_local_engine_events_through_the_mirror(make_engine):
    from kvplay.engine.sampling import SamplingParams

    eng = make_engine(num_blocks=128)
    events = []
    eng.subscribe_batches(lambda b: events.extend(b.events))
    system = {"role": "system", "content": "You are a careful assistant. " * 8}
    for user, q in (("alice", "first question"), ("bob", "tell me about caches"), ("carol", "hi")):
        eng.generate(user, [system, {"role": "user", "content": q}], SamplingParams(max_tokens=4), timeout=60)
    m = Mirror()
    m.apply(EngineBatch(events=list(events)))
    tree = PrefixTree(m.blocks, m.block_hits())
    root = tree.roots[0]
    assert root.creator == "alice" and set(root.reusers) == {"bob", "carol"} and root.hits >= 2 * len(root.keys)
    assert len(root.children) == 3
    text = Labels(eng.tokenizer.decode)(tree, root)
    assert text.startswith("You are a careful assistant.") or "careful assistant" in text
    source = MirrorTrees(m)
    ids = source.block_ids(None, root.keys)
    assert len(ids) == len(root.keys)
    assert tree.node_of(source.key_of(ids[0])[1]) is root
    # the recorded form (plain data, read back) gives the same tree
    again = Mirror()
    for b in as_batches([e.to_dict() for e in events]):
        again.apply(b)
    assert tree_shape(PrefixTree(again.blocks)) == tree_shape(tree)
    # a hostile recorded event is counted where it is read, not raised
    got, bad = decode_events(msgspec.msgpack.encode([
        {"kind": "BlockStored", "block_hashes": [1, 2], "token_ids": "x"},
        {"kind": "BlockStored", "block_hashes": ["a"], "token_ids": ["x"], "block_size": 1}]))
    assert got == [] and bad == 2


# --- kvplay tree ---------------------------------------------------------------------------------
SYSTEM = ("You are a helpful assistant for a bakery. You know the opening hours, the daily bread list, "
          "that cakes must be ordered two days ahead and that nothing is guaranteed nut free.")


def test_kvplay_tree_of_a_recorded_session(tmp_path, capsys, monkeypatch):
    from kvplay.cli import main as cli

    monkeypatch.setenv("KVPLAY_DB", str(tmp_path / "s.db"))
    text = (f'[engine]\nmodel = "tiny:llama"\nnum_blocks = 64\n\n[system]\nprompt = {json.dumps(SYSTEM)}\n\n'
            + "".join(f'[[users]]\nname = "{u}"\nmax_tokens = 4\n\n' for u in ("alice", "bob", "carol"))
            + "".join(f'[[turns]]\nuser = "{u}"\ntext = "{q}"\n\n' for u, q in
                      (("alice", "When are you open?"), ("bob", "Do you sell rye?"), ("carol", "Nut free?"))))
    (tmp_path / "s.toml").write_text(text)
    assert cli(["run", str(tmp_path / "s.toml")]) == 0
    err = capsys.readouterr().err
    sid = err.split("recorded as session ")[1].split()[0] if "recorded as session" in err else None
    if sid is None:
        from kvplay.sessions.store import open_db

        db = open_db(str(tmp_path / "s.db"), create=False)
        sid = next(iter(db.query("select id from sessions")))["id"]
        db.close()
    assert cli(["tree", sid[:10], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    tree = out["pods"]["local"]
    root = tree["roots"][0]
    assert root["creator"] == "alice" and set(root["reused_by"]) == {"bob", "carol"}
    assert len(root["children"]) == 3
    assert "You are a helpful" in root["text"]  # the tiny model's (character) tokenizer, decoded
    total = out["events"]
    assert cli(["tree", sid, "--at", "0"]) == 0
    assert "(no cached blocks)" in capsys.readouterr().out
    for bad in (["tree", sid, "--at", str(total + 1)], ["tree", "nope"], ["tree", sid, "--children", "0"],
                ["tree", sid, "--events", "tcp://127.0.0.1:5"], ["tree", "http://127.0.0.1:9"]):
        assert cli(bad) == 2, bad
        assert capsys.readouterr().err.count("\n") == 1


def test_a_branch_label_starts_where_it_differs_from_its_siblings():
    w = pod()
    m = w.mirror
    store(w, [1, 1, 5, 6], "alice")
    store(w, [1, 1, 5, 7], "bob")  # the prompts diverge inside the second block
    tree = PrefixTree(m.blocks)
    labels = Labels(lambda ids: " ".join(f"t{i}" for i in ids))
    kids = sorted(tree.roots[0].children, key=lambda n: n.creator)
    assert [labels(tree, k) for k in kids] == ["… t6", "… t7"]
    assert labels(tree, tree.roots[0]) == "t1 t1"

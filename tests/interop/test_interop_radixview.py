"""RadixView (PyPI radixview 0.1.0, an SGLang cache viewer) attaches to `kvplay serve` by URL: it
reads GET /server_info's `kv_events`, subscribes to the events and detokenizes through POST
/detokenize; its /api/tree shows the system prompt two users share as one node with a branch per
user. Set up with scripts/radixview-setup.sh; its page is bound to 127.0.0.1."""
from __future__ import annotations

import httpx
import pytest

from support.interop import Tool, venv_python
from support.serve import chat
from support.wait import wait_for

from kvplay.wire.publisher import KVEventsConfig

LAUNCH = ("import sys, radixview.server as s; s._HOST = '127.0.0.1'; "
          "from radixview.cli import main; main(sys.argv[1:])")
SYSTEM = "You are the assistant of a small bakery. Answer every customer briefly and kindly. " * 4


@pytest.mark.radixview
def test_radixview_draws_the_shared_system_prompt_as_one_node(serve, tmp_path, free_port):
    py = venv_python("KVPLAY_RADIXVIEW_VENV", "radixview-venv", ".kvplay-radixview-setup")
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:*")  # bound where the OS says
    srv, state = serve(kv_events=cfg, num_blocks=128)
    view = free_port()
    rv = Tool([py, "-c", LAUNCH, "--server", srv.url, "--view-port", str(view)], tmp_path / "radixview.log")
    try:
        rv.wait_http(f"http://127.0.0.1:{view}/api/tree")
        # its SUB connects after the page is up: the publisher has it before the first turn
        wait_for(lambda: state.side.events.publisher.subscribers >= 1, 60, "RadixView's SUB to connect")
        eng = state.side.engine
        with httpx.Client(timeout=120) as c:
            for user, q in (("alice", "Do you sell rye bread?"), ("bob", "When do you open on Sundays?")):
                assert chat(c, srv.url, content=q, system=SYSTEM, user=user).status_code == 200
        ids = {u: eng.encode([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])[0]
               for u, q in (("alice", "Do you sell rye bread?"), ("bob", "When do you open on Sundays?"))}
        common = next(i for i, (x, y) in enumerate(zip(ids["alice"], ids["bob"])) if x != y)
        shared_blocks = common // eng.config.block_size

        def one_root_two_branches():
            nodes = httpx.get(f"http://127.0.0.1:{view}/api/tree", timeout=5).json().get("nodes") or []
            roots = [n for n in nodes if n["parent"] is None]
            if len(roots) == 1 and len([n for n in nodes if n["parent"] == roots[0]["id"]]) == 2:
                return roots

        try:
            roots = wait_for(one_root_two_branches, 60, poll=0.3)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{rv.text()}") from None
        root = roots[0]
        assert root["blocks"] == shared_blocks > 1  # the shared system prompt: one node
        # its block text came from kvplay's /detokenize: a search for the prompt's words finds the node
        found = httpx.get(f"http://127.0.0.1:{view}/api/search", params={"q": "small bakery"}, timeout=5).json()
        assert found["ids"] == [root["id"]] and root["preview"].startswith("<|im_start|>system")
    finally:
        rv.stop()

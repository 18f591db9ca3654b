"""NVIDIA Dynamo's standalone KV indexer (ai-dynamo-runtime 1.6.1, scripts/dynamo-setup.sh) fed by
`kvplay serve`'s KV events agrees with kvplay's `cached_tokens` on a shared-system-prompt
workload, and differs only where documented (docs/serve.md): a fully cached block-aligned prompt
counts whole in Dynamo, while kvplay, like vLLM, recomputes its last block.

The indexer listens on every interface, so scripts/dynamo_check.py runs it and `kvplay serve` in
a network namespace that has only loopback (`unshare -rn`)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from support import ROOT
from support.interop import venv_python


@pytest.mark.dynamo
def test_dynamo_indexer_agrees_with_cached_tokens():
    py = venv_python("KVPLAY_DYNAMO_VENV", "dynamo-venv", ".kvplay-dynamo-setup")
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rn", "true"]).returncode != 0:
        pytest.skip("needs `unshare -rn` (a loopback-only network namespace for Dynamo's 0.0.0.0 listener)")
    script = f"ip link set lo up && exec {sys.executable} {ROOT / 'scripts' / 'dynamo_check.py'} --dynamo-python {py}"
    r = subprocess.run(["unshare", "-rn", "sh", "-c", script], capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    bs, turns = out["block_size"], out["turns"]
    assert turns[0]["cached_tokens"] == turns[0]["dynamo_tokens"] == 0
    for t in turns[1:]:  # the shared system prompt, then each user's own question
        assert t["dynamo_tokens"] == t["cached_tokens"] > 0, turns
        assert t["cached_tokens"] % bs == 0
    a = out["aligned"]  # a fully cached, block-aligned prompt
    assert a["dynamo_tokens"] == a["prompt_tokens"] and a["cached_tokens"] == a["prompt_tokens"] - bs

"""Capture a real vLLM's KV events (the msgpack payloads, back to back) while four users chat.

Made tests/fixtures/vllm-capture-bakery.msgpack (vLLM 0.32 CPU, SmolLM2-135M, block size 32):
  KVPLAY_VLLM_PORT=8013 KVPLAY_VLLM_THREADS=1 scripts/vllm-cpu.sh start --port 8013 \
      --events tcp://127.0.0.1:5613 --kv-cache-memory-bytes 48000000
  .venv/bin/python scripts/capture_vllm_events.py OUT.msgpack 8013 tcp://127.0.0.1:5613
  KVPLAY_VLLM_PORT=8013 scripts/vllm-cpu.sh stop --port 8013
vLLM connects its PUB socket to a tcp://127.0.0.1 endpoint, so this subscriber binds.
`kvplay import OUT.msgpack` and `kvplay simulate OUT.msgpack` read the result.
"""
import json, sys, threading, time
import httpx, zmq
out, port, ep = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.bind(ep)  # vLLM connects when its endpoint has no '*'
sub.setsockopt(zmq.SUBSCRIBE, b"")
payloads = []
stop = threading.Event()
def rx():
    while not stop.is_set():
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            payloads.append(payload)
t = threading.Thread(target=rx, daemon=True); t.start()
time.sleep(1.0)
SYSTEM = ("You are a helpful assistant for a small bakery. You know the opening hours (Tuesday to Saturday, seven to "
          "three), the daily bread list (sourdough, rye, baguette, seeded spelt), that cakes must be ordered two days "
          "ahead, and that the bakery cannot guarantee anything is nut free because nuts are used in the same kitchen. "
          "Answer briefly and politely. ") * 3
turns = [("alice", "Are you open on Mondays?"), ("bob", "Which breads do you bake every day?"),
         ("carol", "Can I order a birthday cake for tomorrow?"), ("dave", "Is the rye bread nut free?"),
         ("alice", "And on Sundays?"), ("bob", "Is the sourdough made with rye?")]
hist = {}
with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
    for user, text in turns:
        msgs = [{"role": "system", "content": SYSTEM}, *hist.get(user, []), {"role": "user", "content": text}]
        r = c.post("/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct", "messages": msgs, "max_tokens": 24,
                                                 "temperature": 0, "session_id": user})
        r.raise_for_status()
        j = r.json()
        reply = j["choices"][0]["message"]["content"]
        cached = (j["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        print(user, j["usage"]["prompt_tokens"], "cached", cached, flush=True)
        hist.setdefault(user, []).extend([{"role": "user", "content": text}, {"role": "assistant", "content": reply}])
time.sleep(2.0)
stop.set(); t.join()
open(out, "wb").write(b"".join(payloads))
print("batches", len(payloads), "bytes", sum(map(len, payloads)))

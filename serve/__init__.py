"""`kvplay serve`: the engine as an OpenAI-compatible HTTP server with API keys bound to identities, Prometheus /metrics, and vLLM-format KV events."""
from kvplay import only_as

only_as(__name__, "serve")

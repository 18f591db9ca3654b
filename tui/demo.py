"""The built-in demo script (`kvplay screenshot` without --script): three users, one shared
system prompt, questions that overlap so the map shows reuse across users."""
DEMO_TOML = '''
[system]
prompt = "You are a helpful assistant for a team of engineers. Answer briefly and plainly, in two or three sentences at most."

[[users]]
name = "alice"
max_tokens = 40

[[users]]
name = "bob"
max_tokens = 40

[[users]]
name = "carol"
max_tokens = 40

[[turns]]
user = "alice"
text = "What is a KV cache in a transformer?"

[[turns]]
user = "bob"
text = "What is a KV cache in a transformer, and why does it use so much memory?"

[[turns]]
user = "carol"
text = "What is a KV cache in a transformer?"

[[turns]]
user = "alice"
text = "How does sharing it between users help?"
'''

"""The bench's workloads: the same token-level prompts for every peer.

A workload is a list of *rounds*. The turns of one round arrive together (N users asking at the
same moment); a round starts when the previous one has finished (each user's next turn needs
the previous answer). Prompts are built once, as token ids, with the model's chat template, so
every peer sees exactly the same tokens. Assistant turns in the history are fixed, canned
replies (not each peer's own output), so a numerical difference between peers can never change
the next prompt.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvplay.engine.chat import encode_chat
from kvplay.engine.errors import EngineError
from kvplay.sessions.script import load_script, sampling_for

NEW_TOKENS = 32
WORKLOADS = ("shared-system", "conversation", "pressure")

SYSTEM_PROMPT = """\
You are Juniper, the support assistant of Northwind Outfitters, an online shop that sells \
hiking, camping and climbing gear in Europe and North America. You answer customers in a \
friendly, concise and accurate way.

Company facts you may use:
- Orders ship from our warehouses in Rotterdam (Europe) and Denver (North America) within two \
working days. Standard delivery takes three to six working days; express delivery takes one to \
two working days and costs 12 euros or 14 dollars.
- Shipping is free for orders above 80 euros or 90 dollars.
- Customers can return unused items within 60 days for a full refund. Worn or used items can be \
returned within 30 days if they are defective. Return labels are free inside the EU, the UK, the \
USA and Canada.
- Refunds reach the original payment method within five working days after the warehouse \
receives the parcel.
- Every tent, backpack and sleeping bag has a three-year warranty against manufacturing \
defects. Footwear has a one-year warranty. Climbing ropes, harnesses and carabiners are safety \
equipment: they can be returned only unused and in their sealed packaging.
- The loyalty programme, Trailpoints, gives one point per euro or dollar spent. One hundred \
points are worth five euros or five dollars off a later order. Points expire after two years.
- Gift cards never expire and can be used for any product, including sale items.
- Customer service is open Monday to Saturday, 8:00 to 20:00 Central European Time, by chat, \
e-mail (help@northwind.example) and phone.

How to answer:
1. Greet the customer only in your first reply of a conversation.
2. Answer the question first, in one to three short sentences, then add one useful detail.
3. Never invent an order status, a tracking number or a price that is not listed above. If you \
need an order number, ask for it.
4. If a question is about safety (ropes, harnesses, avalanche gear, stoves), remind the \
customer to follow the manufacturer's instructions and, when in doubt, to ask a certified guide.
5. If the customer is upset, acknowledge it in one sentence before answering.
6. Do not discuss competitors, politics or topics unrelated to the shop; politely steer the \
conversation back to the customer's question.
7. Use the customer's currency: euros in Europe, dollars in North America.
8. Keep every answer under 80 words unless the customer asks for a detailed comparison.
"""

QUESTIONS = [
    "How long does express delivery take to Germany?",
    "Can I return a tent I have used once?",
    "My sleeping bag zipper broke after a year. What can I do?",
    "Do Trailpoints expire?",
    "Is shipping free for an order of 95 dollars?",
    "Can I return a climbing rope I never opened?",
    "When will I get my refund after returning boots?",
    "Are you open on Sunday?",
    "Can I use a gift card on sale items?",
    "How much is express shipping to Canada?",
    "What is the warranty on hiking boots?",
    "How many Trailpoints do I need for ten euros off?",
]

CANNED_REPLIES = [
    "Thanks for asking! Here is the short answer, and one detail that may help you plan.",
    "I understand. Based on our policy, this is possible within the limits described above.",
    "Good question. Let me explain what applies to your case and what you can do next.",
]


@dataclass
class Turn:
    user: str
    round: int
    prompt_ids: list[int]
    system_tokens: int  # leading tokens that are the shared system prompt
    cold: bool  # True when no earlier turn of the workload shares this prompt's prefix


@dataclass
class Workload:
    name: str
    description: str
    rounds: list[list[Turn]]
    new_tokens: int = NEW_TOKENS
    num_blocks: int | None = None  # pool size forced by the workload (pressure), else the config's
    notes: list[str] = field(default_factory=list)

    @property
    def turns(self) -> list[Turn]:
        return [t for r in self.rounds for t in r]

    @property
    def users(self) -> list[str]:
        seen: dict[str, None] = {}
        for t in self.turns:
            seen.setdefault(t.user)
        return list(seen)

    def prompt_tokens(self) -> int:
        return sum(len(t.prompt_ids) for t in self.turns)

    def max_context(self) -> int:
        return max(len(t.prompt_ids) for t in self.turns) + self.new_tokens

    def summary(self) -> dict:
        return {"name": self.name, "description": self.description, "users": len(self.users),
                "rounds": len(self.rounds), "requests": len(self.turns), "prompt_tokens": self.prompt_tokens(),
                "new_tokens": self.new_tokens, "num_blocks": self.num_blocks,
                "system_tokens": self.turns[0].system_tokens if self.turns else 0, "notes": list(self.notes)}


def _conversation(user_idx: int, turns: int, system_prompt: str) -> list[list[dict]]:
    """The message lists of one user's `turns` turns (each extends the previous one)."""
    msgs = [{"role": "system", "content": system_prompt}]
    out = []
    for t in range(turns):
        q = QUESTIONS[(user_idx * 5 + t * 7) % len(QUESTIONS)]
        msgs = msgs + [{"role": "user", "content": f"{q} (customer #{user_idx + 1})"}]
        out.append(msgs)
        msgs = msgs + [{"role": "assistant", "content": CANNED_REPLIES[(user_idx + t) % len(CANNED_REPLIES)]}]
    return out


def _rounds(tokenizer, users: int, turns: int, system_prompt: str) -> list[list[Turn]]:
    convs = [_conversation(u, turns, system_prompt) for u in range(users)]
    rounds = []
    for r in range(turns):
        row = []
        for u in range(users):
            ids, sys_len = encode_chat(tokenizer, convs[u][r])
            row.append(Turn(f"user{u + 1}", r, ids, sys_len, cold=(r == 0)))
        rounds.append(row)
    return rounds


def build_workload(name: str, tokenizer, users: int | None = None, turns: int | None = None,
                   block_size: int = 16, new_tokens: int = NEW_TOKENS,
                   system_prompt: str = SYSTEM_PROMPT) -> Workload:
    """Build one named workload for `tokenizer` (token ids, identical for every peer)."""
    if users is not None and users < 1 or turns is not None and turns < 1:
        raise EngineError("--users and --turns must be at least 1")
    if name == "shared-system":
        users, turns = users or 4, turns or 3
        w = Workload(name, f"{users} users x {turns} turns sharing a system prompt, {new_tokens} new tokens, greedy",
                     _rounds(tokenizer, users, turns, system_prompt), new_tokens)
    elif name == "conversation":
        turns = turns or 6
        w = Workload(name, f"one user's conversation growing over {turns} turns", _rounds(tokenizer, 1, turns, system_prompt), new_tokens)
    elif name == "pressure":
        users, turns = users or 8, turns or 2
        w = Workload(name, f"{users} users x {turns} turns through a pool too small for all of them",
                     _rounds(tokenizer, users, turns, system_prompt), new_tokens)
        per_request = -(-w.max_context() // block_size)
        # Room for the shared prefix plus about two private tails: more users than the pool holds,
        # so blocks are evicted between rounds and decodes preempt each other.
        w.num_blocks = per_request + 2 * (per_request - w.turns[0].system_tokens // block_size) + 1
        w.notes.append(f"pool forced to {w.num_blocks} blocks of {block_size} tokens "
                       f"({per_request} blocks per request)")
    else:
        raise EngineError(f"unknown workload {name!r} ({', '.join(WORKLOADS)}, all)")
    return w


def script_workload(path: str, tokenizer, new_tokens: int | None = None) -> Workload:
    """A workload from a `kvplay run` script (e.g. examples/shared-system.toml): its system prompt,
    users and turns. Turns without `at` run in file order, each a round of its own (as `kvplay run`
    plays them); turns with the same `at` arrive together. The first round is cold. A user's later
    turn carries its earlier turns with canned replies (every peer sees the same prompts). Every
    turn generates the same number of tokens: `new_tokens`, else the script's largest max_tokens."""
    script = load_script(path)
    users = {u.name: u for u in script.users}
    history: dict[str, list[dict]] = {}
    groups: list[tuple[float | None, list[tuple[str, list[dict]]]]] = []
    wanted = []
    for i, t in enumerate(script.turns):
        msgs = history.setdefault(t.user, [{"role": "system", "content": script.system}] if script.system else [])
        msgs.append({"role": "user", "content": t.text})
        wanted.append(sampling_for(users[t.user], t).max_tokens)
        if t.at is not None and groups and groups[-1][0] == t.at:
            groups[-1][1].append((t.user, list(msgs)))
        else:
            groups.append((t.at, [(t.user, list(msgs))]))
        msgs.append({"role": "assistant", "content": CANNED_REPLIES[i % len(CANNED_REPLIES)]})
    n = new_tokens or max(wanted)
    rounds = []
    for r, (_, turns) in enumerate(groups):
        row = []
        for user, msgs in turns:
            ids, sys_len = encode_chat(tokenizer, msgs)
            row.append(Turn(user, r, ids, sys_len, cold=(r == 0)))
        rounds.append(row)
    name = "script:" + Path(path).stem
    w = Workload(name, f"{len(users)} users, {len(script.turns)} turns of {path}, {n} new tokens, greedy",
                 rounds, n)
    if len(set(wanted)) > 1:
        w.notes.append(f"every turn generates {n} tokens (the script asks {min(wanted)}–{max(wanted)})")
    w.notes.append("greedy, EOS ignored, whatever temperature the script sets")
    return w


def shared_prefix_len(prompts: list[list[int]]) -> int:
    """Length of the longest common token prefix of `prompts`."""
    if not prompts:
        return 0
    n = min(len(p) for p in prompts)
    first = prompts[0]
    for i in range(n):
        if any(p[i] != first[i] for p in prompts[1:]):
            return i
    return n

"""What changed in the prefix tree between two builds, and how a changed node looks while it
animates (the tree view, tui/tree_view.py, runs the frames).

`diff_trees(old, new, old_hits, new_hits)` compares two `PrefixTree`s of one pod (consecutive
builds from the same events) and returns `Change`s, at most `MAX_CHANGES` (the rest counted):
- **stored**: a node of the new tree holding a block the old one did not have; `who` is that
  block's creator (the node fades in from their colour);
- **reused**: a node one of whose blocks gained hits (`who`: its latest holder; it pulses);
- **evicted**: a node of the old tree all of whose blocks are gone — a *ghost*, shown struck under
  the node that now holds its parent's last block (or at the top) until it fades — or a node that
  lost some of its blocks (`blocks` of them; the surviving node carries the mark). A subtree
  evicted whole is one ghost, its top node.

Cost: one pass over each tree's blocks (on the view's build thread, not the UI's); what a frame
redraws is bounded by `MAX_CHANGES`, whatever the pool size.

`anim_style(kind, phase, colour)` is the look of a mark at `phase` (0 = just happened, 1 = done).
Pure: no Textual.
"""
from __future__ import annotations

from dataclasses import dataclass

from rich.color import Color, blend_rgb
from rich.style import Style

MAX_CHANGES = 128     # nodes animated at once (the rest are counted, not drawn)
DURATION = {"stored": 1.5, "reused": 1.2, "evicted": 1.8}  # seconds a mark takes to settle
FADE_TO = Color.parse("#3a3a3a").get_truecolor()  # what a creator's colour fades towards
MARK = {"stored": "new", "reused": "reused", "evicted": "evicted"}


@dataclass
class Change:
    kind: str            # "stored" | "reused" | "evicted"
    key: object          # first block key of the node it marks (the old node's, for a ghost)
    who: object = None   # creator (stored, evicted) or reuser (reused)
    blocks: int = 0      # blocks stored / reused / evicted in that node
    ghost: object = None  # evicted whole: the old Node (drawn struck until it fades)
    anchor: object = None  # a ghost's parent in the new tree (first key), None: at the top


def diff_trees(old, new, old_hits: dict | None, new_hits: dict | None,
               limit: int = MAX_CHANGES) -> tuple[list[Change], int]:
    """(changes, how many more were left out) from tree `old` to tree `new` (see the module)."""
    if old is None:
        return [], 0
    out: list[Change] = []
    more = 0
    old_blocks, new_blocks = old.blocks, new.blocks
    oh, nh = old_hits or {}, new_hits or {}
    for node in new.nodes:
        stored = reused = 0
        who_stored = who_reused = None
        for k in node.keys:
            if k not in old_blocks:
                if not stored:
                    who_stored = new_blocks[k].creator
                stored += 1
            elif nh.get(k, 0) > oh.get(k, 0):
                if not reused:
                    holders = new_blocks[k].holders
                    who_reused = holders[-1] if holders else None
                reused += 1
        if stored or reused:
            if len(out) >= limit:
                more += 1
                continue
            if stored:
                out.append(Change("stored", node.keys[0], who_stored, stored))
            else:
                out.append(Change("reused", node.keys[0], who_reused, reused))
    gone_whole: set = set()
    for node in old.nodes:  # parents come before their children
        gone = 0
        first_left = None
        for k in node.keys:
            if k in new_blocks:
                if first_left is None:
                    first_left = k
            else:
                gone += 1
        if not gone:
            continue
        if first_left is None:
            gone_whole.add(node.id)
            if node.parent is not None and node.parent.id in gone_whole:
                continue  # part of a subtree evicted whole: its top node stands for it
            if len(out) >= limit:
                more += 1
                continue
            anchor = new.node_of(node.parent.keys[-1]) if node.parent is not None else None
            out.append(Change("evicted", node.keys[0], node.creator, node.blocks_below, ghost=node,
                              anchor=anchor.keys[0] if anchor is not None else None))
        else:
            at = new.node_of(first_left)
            if at is None:
                continue
            if len(out) >= limit:
                more += 1
                continue
            out.append(Change("evicted", at.keys[0], node.creator, gone))
    return out, more


def anim_style(kind: str, phase: float, colour: str | None) -> Style:
    """The mark's style at `phase` in [0, 1]: a store fades from its creator's colour, a reuse
    pulses twice in the reuser's, an eviction is struck through and fades out."""
    phase = min(1.0, max(0.0, phase))
    try:
        rgb = Color.parse(colour).get_truecolor() if colour else FADE_TO
    except Exception:  # a recorded colour that is not one
        rgb = FADE_TO
    if kind == "stored":
        bg = blend_rgb(rgb, FADE_TO, phase)
        return Style(color="#000000" if phase < 0.5 else "#dddddd", bgcolor=Color.from_triplet(bg), bold=True)
    if kind == "reused":
        on = int(phase * 4) % 2 == 0  # two pulses
        return Style(color="#000000", bgcolor=colour or "#bbbbbb", bold=True) if on else Style(color=colour, bold=True)
    fg = blend_rgb(rgb, FADE_TO, phase)
    return Style(color=Color.from_triplet(fg), strike=True, dim=phase > 0.5)


def still_style(kind: str, colour: str | None) -> Style:
    """A mark that does not move (the scrubber at a fixed point: what changed at that step)."""
    if kind == "evicted":
        return Style(color=colour, strike=True)
    return Style(color="#000000", bgcolor=colour or "#bbbbbb", bold=True)

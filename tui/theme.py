"""User colours and glyphs: every user gets a colour *and* a letter, so the app reads in
monochrome and for colour-blind people (the palette is Okabe-Ito, chosen for that)."""
from __future__ import annotations

from dataclasses import dataclass

from rich.color import Color, ColorParseError
from rich.style import Style

# Okabe-Ito (colour-blind safe), then a few extras for larger groups.
PALETTE = ["#E69F00", "#56B4E9", "#009E73", "#CC79A7", "#F0E442", "#D55E00", "#0072B2",
           "#999933", "#88CCEE", "#AA4499"]
FREE_STYLE = Style(color="#4a4a4a")
UNKNOWN_COLOUR = "#bbbbbb"


@dataclass(frozen=True)
class UserLook:
    name: str
    colour: str
    glyph: str  # one upper-case letter or digit

    @property
    def style(self) -> Style:
        return Style(color=self.colour, bold=True)


def assign_looks(names: list[str], colours: dict[str, str | None] | None = None,
                 taken: dict[str, "UserLook"] | None = None) -> dict[str, UserLook]:
    """Give each name a distinct colour and glyph; keep looks already handed out in `taken`."""
    colours = colours or {}
    out: dict[str, UserLook] = dict(taken or {})
    used_glyphs = {l.glyph for l in out.values()}
    used_colours = {l.colour for l in out.values()}
    for name in names:
        if name in out:
            continue
        glyph = next((c.upper() for c in name + "0123456789" if c.isalnum() and c.upper() not in used_glyphs), "?")
        colour = _colour(colours.get(name)) or next((c for c in PALETTE if c not in used_colours),
                                                    PALETTE[len(out) % len(PALETTE)])
        out[name] = UserLook(name, colour, glyph)
        used_glyphs.add(glyph)
        used_colours.add(colour)
    return out


def _colour(value) -> str | None:
    """A colour a script or a recording asks for, if Rich reads it as one (else None: the palette's)."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        Color.parse(value)
    except ColorParseError:
        return None
    return value

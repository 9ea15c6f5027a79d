"""The PNG beside a probe's JSON and markdown (``benchmarks.common.write_probe_table``): GB/s as bars, ceilings
as horizontal lines, drawn with matplotlib when it imports; without it the PNG is left out and said so."""

from __future__ import annotations

import os
import textwrap

from .common import save_figure

#: Line styles of the ceilings, in turn (a colour each from matplotlib's cycle after the bars').
CEILING_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1)))


def png_path(json_path: str) -> str:
    """The PNG's path: the JSON's with ``.png`` for ``.json`` (the markdown's base name)."""
    return os.path.splitext(json_path)[0] + ".png"


def line_label(what: str, io_mode: str | None) -> str:
    """A ceiling's name on the plot: its row's name without ``ceiling: ``, with its io mode where it has one."""
    return what.removeprefix("ceiling: ") + (f" ({io_mode})" if io_mode else "")


def gbps_plot(json_path: str, title: str, groups: dict[str, dict[str, float | None]],
              ceilings: dict[str, float | None]) -> str | None:
    """Write ``<json_path without .json>.png``: bars per group (a series one colour throughout), ceilings as
    lines, None named as not run; its path, or None without matplotlib (said so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"no plot ({e}): install matplotlib (pip install 'gdsload[bench]') and run again for "
              f"{png_path(json_path)}", flush=True)
        return None
    series = list(dict.fromkeys(s for values in groups.values() for s in values))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(groups) * max(1, len(series)) + 2), 5.0))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g, values in enumerate(groups.values())
              if values.get(name) is not None]
        ys = [values[name] for values in groups.values() if values.get(name) is not None]
        bars = ax.bar(xs, ys, width, label=name, color=colours[i % len(colours)])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    for j, (name, value) in enumerate(ceilings.items()):
        style = CEILING_STYLES[j % len(CEILING_STYLES)]
        colour = colours[(len(series) + j) % len(colours)]
        if value is None:
            ax.plot([], [], linestyle=style, color=colour, label=f"{name}: not run")
        else:
            ax.axhline(value, linestyle=style, color=colour, label=f"{name}: {value:.2f}")
    ax.set_xticks(range(len(groups)), [textwrap.fill(g, 22) for g in groups], fontsize=8)
    ax.set_ylabel("GB/s (GB = 1e9 bytes)")
    ax.set_title(title, fontsize=10)
    drawn = [v for values in groups.values() for v in values.values() if v is not None]
    drawn += [v for v in ceilings.values() if v is not None]
    ax.set_ylim(0, 1.5 * max(drawn) if drawn else 1.0)  # head room: the legend above the bars and lines
    ax.legend(fontsize=7, loc="upper left", ncol=2 if len(series) + len(ceilings) > 3 else 1)
    out = png_path(json_path)
    save_figure(fig, out)
    print("wrote", out, flush=True)
    return out

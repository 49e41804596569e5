"""Pictures of the numbers that come in long tables: where in the model's depth minillm leaves
transformers (`compare --per-layer --plot`), and how the precisions' perplexities compare
(`perplexity --plot`). matplotlib is an optional extra: `pip install 'minillm[plot]'`."""

from __future__ import annotations

from pathlib import Path

from .errors import UsageError

EXTRA = "minillm[plot]"
FORMATS = (".png", ".svg")


def check_plot(path: str | Path) -> None:
    """Before any work: the file type is one we draw, and matplotlib is installed."""
    _pyplot(path)


def _pyplot(path: str | Path):
    if Path(path).suffix.lower() not in FORMATS:
        raise UsageError(f"--plot {path}: the file must end in .png or .svg")
    try:
        import matplotlib
    except ImportError:
        raise UsageError(f"plots need matplotlib: pip install '{EXTRA}'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_layers(layers: dict, path: str | Path, title: str = "") -> int | None:
    """Relative L2 and max abs difference per stage (compare's "layers" result) on a log scale,
    the divergence threshold as a line, the first divergent stage marked. Returns that stage's
    index on the x axis (None if nothing diverges)."""
    plt = _pyplot(path)
    stages = layers["stages"]
    names = [s["stage"] for s in stages]
    x = list(range(len(stages)))
    floor = 1e-12  # exact zeros would vanish from a log axis
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(stages) + 2), 4.2))
    ax.plot(x, [max(s["rel_l2"], floor) for s in stages], marker="o", ms=3, label="relative L2 error")
    ax.plot(x, [max(s["max_abs"], floor) for s in stages], marker="s", ms=3, label="max abs difference")
    ax.axhline(layers["threshold"], color="gray", linestyle="--", linewidth=1, label=f"threshold {layers['threshold']:g}")
    marked = names.index(layers["first_divergence"]) if layers["first_divergence"] in names else None
    if marked is not None:
        ax.axvline(marked, color="crimson", linewidth=1.2)
        ax.annotate(f"first divergence: {names[marked]}", (marked, layers["threshold"]), xytext=(6, 10),
                    textcoords="offset points", color="crimson")
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([n.replace("layer ", "") if n.startswith("layer ") else n for n in names], rotation=90, fontsize=7)
    ax.set_xlabel("stage (embedding, layer, final norm)")
    ax.set_ylabel("minillm vs transformers (hidden state)")
    ax.set_title(title or "Where minillm leaves transformers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return marked


def plot_perplexity(by_dtype: dict[str, float], path: str | Path, reference: float | None = None, title: str = "") -> None:
    """One bar per precision minillm ran, and transformers' float32 perplexity as a line."""
    plt = _pyplot(path)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    names = list(by_dtype)
    bars = ax.bar(names, [by_dtype[n] for n in names], color="#4c78a8")
    ax.bar_label(bars, fmt="%.4f", fontsize=8)
    if reference is not None:
        ax.axhline(reference, color="crimson", linestyle="--", linewidth=1, label=f"transformers float32 {reference:.4f}")
        ax.legend(fontsize=8)
    low, high = min(by_dtype.values()), max(by_dtype.values())
    ax.set_ylim(low * 0.98, high * 1.02)  # the differences are small: look at them
    ax.set_ylabel("perplexity")
    ax.set_title(title or "Perplexity by weight precision")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

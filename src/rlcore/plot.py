"""Curves of a run, from its ``metrics.jsonl``: ``python -m rlcore.plot METRICS... [-o FILE]``.

Panels against the rollout (its number: the metrics step): the sampled reward
(``rollout/reward``), held-out accuracy (every ``eval/NAME/reward``), KL (``rollout/kl_penalty``
or the actor's ``kl_loss``), entropy (the sampled tokens' ``rollout/entropy``, or the actor's
``entropy``) and seconds per step (the sum of the ``perf/*_s`` times). Several files are drawn
over each other, one line each, named by ``--label`` or by the folder that holds the file;
``--table`` prints the held-out accuracy at each evaluation as a Markdown table instead of (or
beside) the picture.

The picture needs matplotlib (``pip install 'rlcore[plot]'``); the table does not.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from rlcore.errors import BackendUnavailableError
from rlcore.loop.metrics import read_jsonl_metrics

__all__ = ["PANELS", "curves", "heldout_table", "main", "plot"]

Curve = list[tuple[int, float]]

PANELS: Mapping[str, tuple[str, ...]] = {
    "sampled reward": ("rollout/reward",),
    "held-out accuracy": ("eval/",),
    "KL": ("rollout/kl_penalty", "train/actor/kl_loss"),
    "entropy": ("rollout/entropy", "train/actor/entropy"),
    "seconds per step": ("perf/",),
}
"""Each panel's metrics, by name or by prefix (a name ending in ``/``)."""


def curves(rows: Sequence[Mapping[str, float]]) -> dict[str, dict[str, Curve]]:
    """Per panel, the curves found in ``rows`` (a run's metrics): ``{panel: {metric: [(step,
    value), ...]}}``. Held-out accuracy is each eval set's ``reward``; seconds per step is one
    curve, the sum of a row's ``perf/*_s``."""
    out: dict[str, dict[str, Curve]] = {panel: {} for panel in PANELS}
    for row in rows:
        step = int(row["step"])
        perf = [v for k, v in row.items() if k.startswith("perf/") and k.endswith("_s")]
        if perf:
            out["seconds per step"].setdefault("perf/step_s", []).append((step, math.fsum(perf)))
        for key, value in row.items():
            if value is None or key == "step":
                continue
            if key.startswith("eval/") and key.endswith("/reward"):
                out["held-out accuracy"].setdefault(key, []).append((step, float(value)))
                continue
            for panel, names in PANELS.items():
                if panel not in ("held-out accuracy", "seconds per step") and key in names:
                    out[panel].setdefault(key, []).append((step, float(value)))
    return out


def heldout_table(runs: Mapping[str, Sequence[Mapping[str, float]]]) -> str:
    """A Markdown table of each eval set's accuracy at every evaluated rollout, one row per run
    (``runs``: label -> metrics rows)."""
    columns: dict[str, set[int]] = {}
    values: dict[tuple[str, str, int], float] = {}
    for label, rows in runs.items():
        for name, points in curves(rows)["held-out accuracy"].items():
            columns.setdefault(name, set()).update(step for step, _ in points)
            values.update({(label, name, step): value for step, value in points})
    lines = []
    for name, steps in sorted(columns.items()):
        ordered = sorted(steps)
        lines.append(f"{name} after rollout | " + " | ".join(str(s) for s in ordered))
        lines.append("|".join(["---"] * (len(ordered) + 1)))
        for label in runs:
            cells = [values.get((label, name, s)) for s in ordered]
            lines.append(
                f"{label} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in cells)
            )
        lines.append("")
    return "\n".join(lines)


def plot(runs: Mapping[str, Sequence[Mapping[str, float]]], out: Path) -> None:
    """Draw every panel of every run (``runs``: label -> metrics rows) into the image ``out``
    (its folder is created)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BackendUnavailableError(
            "rlcore.plot draws with matplotlib: pip install 'rlcore[plot]' (or use --table)"
        ) from exc
    panels = list(PANELS)
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for axis, panel in zip(axes, panels, strict=True):
        for label, rows in runs.items():
            for name, points in curves(rows)[panel].items():
                steps, values = zip(*points, strict=True) if points else ((), ())
                shown = label if len(curves(rows)[panel]) == 1 else f"{label} {name}"
                axis.plot(steps, values, label=shown, linewidth=1.2)
        axis.set_title(panel)
        axis.set_xlabel("rollout")
        if axis.lines:
            axis.legend(fontsize=7)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcore.plot", description=__doc__)
    parser.add_argument("metrics", type=Path, nargs="+", help="metrics.jsonl files")
    parser.add_argument("-o", "--output", type=Path, default=None, help="image to write (.png)")
    parser.add_argument("--label", action="append", default=None, help="one per file")
    parser.add_argument("--table", action="store_true", help="print held-out accuracy as Markdown")
    args = parser.parse_args(argv)
    labels = args.label or [path.parent.name or str(path) for path in args.metrics]
    if len(labels) != len(args.metrics):
        parser.error(f"{len(args.metrics)} files but {len(labels)} --label")
    runs = {}
    for label, path in zip(labels, args.metrics, strict=True):
        if not path.is_file():
            parser.error(f"{path}: no such file")
        runs[label] = read_jsonl_metrics(path)
    if args.table or args.output is None:
        print(heldout_table(runs))
    if args.output is not None:
        try:
            plot(runs, args.output)
        except BackendUnavailableError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The downstream tasks of a run (eval.tasks) in its report: accuracy against tokens trained on, with
each task's chance level drawn, and a table of the first, last and best evaluation."""

from __future__ import annotations

from raytrain_fast.report.load import RunMetrics

PREFIX = "eval/"
TITLE = "Downstream accuracy"
CAPTION = (
    "Accuracy of each task of eval.tasks against the tokens trained on: acc (solid, the choice with the highest "
    "log-likelihood) and acc_norm (dashed, per character of the choice); the dotted grey lines are the tasks' chance levels."
)


def task_points(run: RunMetrics, name: str) -> list[dict[str, float]]:
    """Each evaluation of task `name`: tokens (trained on by then), step, acc, acc_norm, chance, items."""
    tokens_per_step = (run.setting("train", "global_batch", 0) or 0) * (run.setting("data", "seq_len", 0) or 0)
    points = []
    for record in run.records:
        if f"{PREFIX}{name}/acc" not in record:
            continue
        get = lambda metric, default=0.0: float(record.get(f"{PREFIX}{name}/{metric}", default))  # noqa: E731
        points.append({
            "tokens": float(record.get("eval/tokens", record["step"] * tokens_per_step)), "step": float(record["step"]),
            "acc": get("acc"), "acc_norm": get("acc_norm"), "chance": get("chance", float("nan")), "items": get("items"),
        })
    return points


def draw_tasks(run: RunMetrics, axis) -> str | None:
    """Accuracy against tokens trained on, on `axis` (report/plots.py draws the figure); returns why
    it was not drawn, or None."""
    names = run.names_under(PREFIX, "/acc")  # the tasks the run scored
    if not names:
        return "the run scored no tasks (eval.tasks, docs/evaluation.md)"
    from matplotlib.ticker import FuncFormatter

    chances: dict[float, list[str]] = {}
    for index, name in enumerate(names):
        points, color = task_points(run, name), f"C{index % 10}"
        x = [p["tokens"] for p in points]
        axis.plot(x, [p["acc"] for p in points], marker="o", color=color, label=f"{name} acc ({int(points[-1]['items'])} items)")
        axis.plot(x, [p["acc_norm"] for p in points], marker=".", linestyle="--", color=color, label=f"{name} acc_norm")
        chances.setdefault(round(points[-1]["chance"], 3), []).append(name)
    for chance, tasks in chances.items():  # one line per level: tasks of equal chance share it
        axis.axhline(chance, color="0.35", linestyle=":", linewidth=1.2, label=f"chance {chance:.2f} ({', '.join(tasks)})")
    axis.set_xlabel("tokens trained on")
    axis.set_ylabel("accuracy")
    axis.set_ylim(0, 1.03)
    axis.set_xlim(left=0)
    axis.xaxis.set_major_formatter(FuncFormatter(_tokens))
    return None


def _tokens(value: float, _position: object) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


def task_rows(run: RunMetrics) -> list[dict[str, str]]:
    """Per task: its first and last evaluation, its best acc, chance and items, formatted."""
    rows = []
    for name in run.names_under(PREFIX, "/acc"):
        points = task_points(run, name)
        first, last = points[0], points[-1]
        best = max(points, key=lambda p: p["acc"])
        rows.append({
            "task": name, "chance": f"{last['chance']:.3f}", "items": f"{int(last['items']):,}",
            "first": f"{first['acc']:.3f} (step {int(first['step']):,})", "last": f"{last['acc']:.3f} / {last['acc_norm']:.3f} (step {int(last['step']):,})",
            "best acc": f"{best['acc']:.3f} (step {int(best['step']):,})",
        })
    return rows


def task_lines(run: RunMetrics) -> list[str]:
    """The report's text: one line per task, or none."""
    rows = task_rows(run)
    if not rows:
        return []
    lines = ["Downstream tasks (acc; last: acc / acc_norm):"]
    lines += [f"  {r['task']}: first {r['first']}, last {r['last']}, best {r['best acc']}; chance {r['chance']}, {r['items']} items"
              for r in rows]
    return lines

"""``lrmoe presets``: the named model shapes, with total and active parameter counts."""

from __future__ import annotations

import argparse

from lrmoe.commands.columns import aligned

FAMILIES = {"qwen3_moe": "Qwen3-MoE", "glm4_moe": "GLM-4.5-MoE"}


def human(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}" if n < 100 * size else f"{n / size:.0f}{unit}"
    return str(n)


def table() -> list[list[str]]:
    from lrmoe.presets import PRESETS, get_preset, param_counts

    rows = [["name", "family", "layers", "moe layers", "hidden", "experts", "top-k",
             "total params", "active params"]]
    for name in PRESETS:
        c = get_preset(name)
        total, active = param_counts(c)
        experts = str(c.num_experts) + (f"+{c.n_shared_experts} shared"
                                        if c.n_shared_experts else "")
        rows.append([name, FAMILIES.get(c.model_type, c.model_type), str(c.num_hidden_layers),
                     str(len(c.moe_layers)), str(c.hidden_size), experts,
                     str(c.num_experts_per_tok), human(total), human(active)])
    return rows


def register(sub) -> None:
    p = sub.add_parser("presets", help="list the model presets",
                       description="List the named model shapes with parameter counts.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = table()
    rule = ["-" * max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(aligned(rows[:1], [rule] + rows[1:], {0, 1}))
    return 0

"""Text forms of an operator inventory: flat rows (JSON / CSV) and the summary tables the CLI and docs show."""
from __future__ import annotations

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.meta import format_bytes, format_count
from latentmoe_lab.porting.flops import expected_flops
from latentmoe_lab.porting.inventory import Inventory


def inventory_rows(inventory: Inventory) -> list[dict]:
    """One plain dict per (layer type, op), most FLOPs first."""
    return [{"layer_type": r.layer_type, "op": r.op, "kind": r.kind, "count": r.count, "flops": r.flops,
             "bytes_read": r.bytes_read, "bytes_written": r.bytes_written,
             "shapes": " | ".join(str(list(s)) for s in r.shapes), "dtypes": " | ".join(",".join(d) for d in r.dtypes)}
            for r in sorted(inventory.rows, key=lambda r: (-r.flops, -r.bytes, r.layer_type, r.op))]


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:5.1f}%" if whole else "    -"


def top_table(inventory: Inventory, key: str, top: int = 10) -> str:
    """A markdown table of the `top` ops (merged over layer types) by "flops" or "bytes"."""
    lines = ["| op | kind | calls | FLOPs | share | bytes | share |", "|---|---|---:|---:|---:|---:|---:|"]
    for row in inventory.top(key, top):
        lines.append(f"| {row.op} | {row.kind} | {row.count} | {format_count(row.flops)} | "
                     f"{_share(row.flops, inventory.total_flops)} | {format_bytes(row.bytes)} | "
                     f"{_share(row.bytes, inventory.total_bytes)} |")
    return "\n".join(lines)


def by_layer_type(inventory: Inventory) -> str:
    """FLOPs, bytes and custom-work share per layer type (markdown)."""
    sums: dict[str, list[int]] = {}
    for row in inventory.rows:
        entry = sums.setdefault(row.layer_type or "(outside modules)", [0, 0, 0, 0])
        entry[0] += row.count
        entry[1] += row.flops
        entry[2] += row.bytes
        entry[3] += row.flops if row.kind == "custom" else 0
    lines = ["| layer type | op calls | FLOPs | share | bytes | custom-work FLOPs |", "|---|---:|---:|---:|---:|---:|"]
    for name, (count, flops, nbytes, custom) in sorted(sums.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name} | {count} | {format_count(flops)} | {_share(flops, inventory.total_flops)} | "
                     f"{format_bytes(nbytes)} | {_share(custom, flops)} |")
    return "\n".join(lines)


def inventory_summary(inventory: Inventory, config: ModelConfig, top: int = 10) -> str:
    """Header with FLOPs per token against the closed form, then per layer type, top by FLOPs and by bytes."""
    expected = expected_flops(config, inventory.phase, inventory.tokens, inventory.context)
    what = (f"{inventory.tokens} new tokens after {inventory.context} cached" if inventory.phase == "prefill"
            else f"{inventory.tokens} sequences x 1 token, {inventory.context} cached each")
    custom = sum(r.flops for r in inventory.rows if r.kind == "custom")
    return "\n".join([
        f"{inventory.preset} {inventory.phase} ({what}); one block per kind, counted once per layer of its kind",
        f"FLOPs per token: {format_count(inventory.flops_per_token())} dispatched, "
        f"{format_count(expected['total'] / inventory.tokens)} closed form "
        f"(ratio {inventory.total_flops / expected['total']:.4f}); bytes moved per token: "
        f"{format_bytes(inventory.total_bytes / inventory.tokens)}; custom-work ops carry "
        f"{_share(custom, inventory.total_flops).strip()} of the FLOPs",
        "", by_layer_type(inventory), "", f"top {top} ops by FLOPs:", top_table(inventory, "flops", top),
        "", f"top {top} ops by bytes:", top_table(inventory, "bytes", top)])

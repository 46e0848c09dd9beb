"""``kvstore stats --server ADDR``: what a running kvstore-server says of itself, as text.

The offline ``kvstore stats`` (:mod:`kvstore.cli.survey`) reads disk tiers without
opening a store, so it knows no live figure. This formats a server's ``STATS``
reply instead (as the token sees it: a tenant's token its own stores and figures,
the operator's every one): per store, each tier's blocks and the read speed the
restore planner uses now (measured, probed or configured; the correction its restores
keep and their median error), the restore plans' tokens and the planned against the
actual load time; per tenant, its bytes per
tier against its share and limit, hits, misses, evictions, refusals and reclaims.
"""

from __future__ import annotations

from typing import Any

from kvstore.config import format_size as human_bytes

__all__ = ["format_server_stats"]


def format_server_stats(stats: dict[str, Any], address: str) -> str:
    """Text of a ``STATS`` reply (``Client.server_stats()``) from the server at ``address``."""
    stores = stats.get("stores", [])
    lines = [f"kvstore-server {address}: {len(stores)} store(s) open"]
    for store in stores:
        lines.extend(_store_lines(store))
    tenants = stats.get("tenants") or {}
    if tenants:
        lines.append("tenants:")
    for name, figures in sorted(tenants.items()):
        lines.extend(_tenant_lines(name, figures))
    return "\n".join(lines)


def _store_lines(store: dict[str, Any]) -> list[str]:
    head = (
        f"namespace {store.get('namespace', '?')}, layout {str(store.get('layout_fp', '?'))[:12]}: "
        f"{store.get('blocks', 0):,} blocks, lookup hit rate {store.get('lookup_hit_rate', 0):.1%}"
    )
    out = [head]
    for tier in store.get("tiers", []):
        out.append("  " + _tier_line(tier))
    restore = store.get("restore") or {}
    if restore:
        out.append("  " + _restore_line(restore))
    return out


def _tier_line(tier: dict[str, Any]) -> str:
    speed = tier.get("read_gbps_estimate")
    latency = tier.get("read_latency_ms_estimate")
    reads = (
        f"reads {speed:.3g} GB/s + {latency:.3g} ms a call ({tier.get('read_speed_source', '?')}, "
        f"{tier.get('read_speed_samples', 0):.0f} samples{_loop(tier)})"
        if speed is not None and latency is not None
        else "reads: no estimate"
    )
    held = f"{tier.get('blocks', 0):,} blocks ({human_bytes(int(tier.get('bytes', 0)))})"
    return f"{tier.get('kind', '?'):<8} {held}, {reads}, {tier.get('evictions', 0):,} evictions"


def _loop(tier: dict[str, Any]) -> str:
    """The closed loop's figures: the correction the price carries, the plans' error."""
    k, error = tier.get("read_correction"), tier.get("read_estimate_error")
    out = f", priced x{k:.3g}" if isinstance(k, (int, float)) else ""
    return out + (f", restores {error:+.0%} off" if isinstance(error, (int, float)) else "")


def _restore_line(restore: dict[str, Any]) -> str:
    planning = "on" if restore.get("planning") else "off"
    error = restore.get("estimate_error_median")
    err = f"{error:+.0%}" if isinstance(error, (int, float)) else "n/a"
    return (
        f"restore planning {planning}: {restore.get('plans', 0):,} plans, tokens to load "
        f"{restore.get('tokens_planned_load', 0):,} / to recompute "
        f"{restore.get('tokens_planned_recompute', 0):,}; load time planned "
        f"{restore.get('load_planned_s', 0):.3f} s, actual {restore.get('load_actual_s', 0):.3f} s "
        f"(median error {err}); prefill {_prefill(restore)}"
    )


def _prefill(restore: dict[str, Any]) -> str:
    rate = restore.get("prefill_tokens_per_s")
    source = restore.get("prefill_source", "unknown")
    return f"{rate:,.0f} tokens/s ({source})" if rate else f"unknown ({source})"


def _tenant_lines(name: str, figures: dict[str, Any]) -> list[str]:
    counts = ", ".join(
        f"{key} {int(figures.get(key, 0)):,}"
        for key in ("hits", "misses", "evictions", "refused", "reclaimed")
    )
    out = [f"  {name}: {counts}"]
    for kind, tier in sorted((figures.get("tiers") or {}).items()):
        quota = ""
        if "share" in tier:
            quota = f" (share {human_bytes(tier['share'])}, limit {human_bytes(tier['limit'])})"
        out.append(f"    {kind:<8} {human_bytes(int(tier.get('bytes', 0)))}{quota}")
    return out

"""Restore planning: how much of a stored prefix is worth loading, and the live speeds
it weighs.

- :mod:`kvstore.restore.planner` -- the plan itself (``plan_restore``, ``RestorePlan``):
  pure arithmetic over the tiers' read speeds and the engine's prefill speed
- :mod:`kvstore.restore.restorer` -- ``Restorer``: plans for one store, counts what it
  planned against what the loads cost, and warms what plans leave on slow tiers
- :mod:`kvstore.restore.speeds` -- ``ReadSpeed``: a tier's live read speed, priced by
  what restores cost (a closed loop)
- :mod:`kvstore.restore.prefill` -- ``PrefillSpeed``: the engine's prefill speed
- :mod:`kvstore.restore.stats` -- planned against actual loads (``LoadSample``,
  ``PlannedLoad``, ``RestoreStats``)
- :mod:`kvstore.restore.contracts` -- ``RestorerParts``, what the restorer asks of the
  data path, and ``Restoring``, what a store asks of the restorer

This package sits below the data path and never imports it: the data path implements
``RestorerParts``. Code outside imports these names from here (or the contracts module);
each is imported on first use. docs/restore.md tells the whole story.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.restore.contracts import RestorerParts, Restoring
    from kvstore.restore.planner import (
        TIE,
        RestoreCosts,
        RestorePlan,
        RestoreRequest,
        medium_of,
        plan_restore,
        restore_request,
    )
    from kvstore.restore.prefill import PrefillEstimate, PrefillSpeed
    from kvstore.restore.restorer import Restorer, Warming
    from kvstore.restore.speeds import (
        CORRECTION_BOUNDS,
        PROBE_LAYERS,
        PROBE_READS,
        SPREAD,
        DecayedFit,
        ReadSpeed,
        SpeedEstimate,
        fastest_reads,
    )
    from kvstore.restore.stats import LoadMark, LoadSample, PlanCounts, PlannedLoad, RestoreStats

__all__ = [
    "CORRECTION_BOUNDS",
    "DecayedFit",
    "LoadMark",
    "LoadSample",
    "PROBE_LAYERS",
    "PROBE_READS",
    "PlanCounts",
    "PlannedLoad",
    "PrefillEstimate",
    "PrefillSpeed",
    "ReadSpeed",
    "RestoreCosts",
    "RestorePlan",
    "RestoreRequest",
    "RestoreStats",
    "Restorer",
    "RestorerParts",
    "Restoring",
    "SPREAD",
    "SpeedEstimate",
    "TIE",
    "Warming",
    "fastest_reads",
    "medium_of",
    "plan_restore",
    "restore_request",
]

_EXPORTS = {
    "CORRECTION_BOUNDS": "kvstore.restore.speeds",
    "DecayedFit": "kvstore.restore.speeds",
    "LoadMark": "kvstore.restore.stats",
    "LoadSample": "kvstore.restore.stats",
    "PROBE_LAYERS": "kvstore.restore.speeds",
    "PROBE_READS": "kvstore.restore.speeds",
    "PlanCounts": "kvstore.restore.stats",
    "PlannedLoad": "kvstore.restore.stats",
    "PrefillEstimate": "kvstore.restore.prefill",
    "PrefillSpeed": "kvstore.restore.prefill",
    "ReadSpeed": "kvstore.restore.speeds",
    "RestoreCosts": "kvstore.restore.planner",
    "RestorePlan": "kvstore.restore.planner",
    "RestoreRequest": "kvstore.restore.planner",
    "RestoreStats": "kvstore.restore.stats",
    "Restorer": "kvstore.restore.restorer",
    "RestorerParts": "kvstore.restore.contracts",
    "Restoring": "kvstore.restore.contracts",
    "SPREAD": "kvstore.restore.speeds",
    "SpeedEstimate": "kvstore.restore.speeds",
    "TIE": "kvstore.restore.planner",
    "Warming": "kvstore.restore.restorer",
    "fastest_reads": "kvstore.restore.speeds",
    "medium_of": "kvstore.restore.planner",
    "plan_restore": "kvstore.restore.planner",
    "restore_request": "kvstore.restore.planner",
}


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)

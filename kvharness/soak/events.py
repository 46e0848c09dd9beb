"""The KV events of the memory soak's kvstore-server, and whether a subscriber's view converges.

The soak's server (:mod:`kvharness.soak.run`) publishes KV events on two free ports
(the chaos soak's node config: a small replay buffer, so a subscriber that comes back
is sent snapshots); a share of its clients' puts tell it their chunks' tokens, so those
chunks are announced. :class:`SoakEvents` keeps one long-lived
:class:`~kvharness.event_view.EventView` on the server for the whole run and
restarts it at seeded random moments (a router restarting, with the replay socket),
through the chaos soak's :class:`~kvharness.chaos.events.EventWatch`. At the
end, once the clients have stopped and one heartbeat has passed, the long-lived view
is compared with a fresh subscriber's (a snapshot of what the server holds now): no
phantom, missed or wrong-medium block. Apart from :mod:`kvharness.soak.run` so the
soak's memory sampling and its event check each stay readable on their own.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from kvharness.chaos.events import EventWatch, event_ports, node_events_config
from kvharness.soak.work import LAYOUT

__all__ = ["EVENT_FIELDS", "SoakEvents", "server_events_config"]

#: The figures :meth:`SoakEvents.finish` always reports (0 unless something differed).
EVENT_FIELDS = ("events_phantom", "events_missed", "events_wrong_medium", "events_unanswered")
_NAME = "server"


def server_events_config(workdir: Path) -> dict[str, Any]:
    """The soak server's ``events:`` section: PUB and replay on free ports, its token
    journal in ``workdir``, one published block per chunk of :data:`LAYOUT`."""
    return node_events_config(event_ports(1)[0], workdir, LAYOUT.block_tokens)


class SoakEvents:
    """One long-lived view of the server's events, restarted now and then, checked at
    the end against a fresh one.

    ``events``: the server's ``events:`` section (:func:`server_events_config`);
    ``every_s``: seconds between two restarts of the view, on average.
    """

    def __init__(self, events: dict[str, Any], seed: int, every_s: float) -> None:
        self.heartbeat_s = float(events["heartbeat_s"])
        ends = (str(events["endpoint"]), str(events["replay_endpoint"]))
        self.watch = EventWatch({_NAME: ends}, seed, every_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SoakEvents:
        """Subscribe, and restart the view at random moments until :meth:`finish`."""
        self.watch.start()
        self._thread = threading.Thread(
            target=self.watch.run, args=(self._stop,), name="soak-event-restarts", daemon=True
        )
        self._thread.start()
        return self

    def finish(self, timeout: float = 30.0) -> dict[str, Any]:
        """Stop the restarts, wait one heartbeat, compare the long-lived view with a
        fresh one; the soak's ``events_*`` figures (the view counters included).
        Call it once the load has stopped and while the server still runs."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        time.sleep(self.heartbeat_s)
        try:
            found = self.watch.check([_NAME], timeout)
        finally:
            self.watch.close()
        out: dict[str, Any] = dict.fromkeys(EVENT_FIELDS, 0)
        out.update({f"events_{what}": int(n) for what, n in found.items() if what != "examples"})
        if "examples" in found:
            out["events_examples"] = found["examples"]
        return out

    def close(self) -> None:
        """Stop without a check (the soak failed before its end)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.watch.close()

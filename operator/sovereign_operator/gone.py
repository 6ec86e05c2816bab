"""An LLMDeployment that no longer exists, as a part of the operator finds out by reading it.

The watch cache (what the loop serves) may hold an object's last body for a moment after it went (a
DELETED still on its way, a watch that expired). Whatever reads the object itself (the reconciler, the autoscaler) and gets nothing, or an object of another uid
(deleted and created again under the same name), raises DeploymentGone; the loop then drops
everything it keeps for that object and serves the stale body no more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class DeploymentGone(Exception):
    """The LLMDeployment (namespace, name, uid) is deleted, or its namespace is."""

    def __init__(self, namespace: str, name: str, uid: str | None) -> None:
        super().__init__(f"LLMDeployment {namespace}/{name} no longer exists")
        self.namespace, self.name, self.uid = namespace, name, uid


def is_gone(body: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    """Whether `live` (a fresh read, None on 404) says the object `body` describes is gone."""
    if live is None:
        return True
    uid, live_uid = (body.get("metadata") or {}).get("uid"), (live.get("metadata") or {}).get("uid")
    return bool(uid and live_uid and uid != live_uid)


def gone_error(body: Mapping[str, Any]) -> DeploymentGone:
    meta = body.get("metadata") or {}
    return DeploymentGone(str(meta.get("namespace")), str(meta.get("name")), meta.get("uid"))

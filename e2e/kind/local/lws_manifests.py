"""LeaderWorkerSet's own manifests (`kubectl kustomize <module>/config/default`, on stdin) made fit for a
small kind cluster with no registry (make e2e-kind), written to stdout:

- the controller's image is the one built into the node image (argv[1]), never pulled;
- one replica asking 100m CPU and 256Mi, where upstream asks two replicas of 1 CPU and 1Gi each (on a
  2-core machine that alone would hold every CPU the scheduler sees on one worker);
- a numeric non-root user, since the image is the static binary alone (FROM scratch, no passwd) and
  the pod says runAsNonRoot.

Everything else (CRDs, RBAC, webhooks, the certificate the controller makes for them) is upstream's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import yaml

CONTROLLER = "lws-controller-manager"
NON_ROOT = 65532


def fit_for_kind(documents: Iterable[dict[str, Any] | None], image: str) -> list[dict[str, Any]]:
    out = []
    found = False
    for doc in documents:
        if not doc:
            continue
        if doc.get("kind") == "Deployment" and doc["metadata"]["name"] == CONTROLLER:
            found = True
            spec = doc["spec"]
            spec["replicas"] = 1
            pod = spec["template"]["spec"]
            pod.setdefault("securityContext", {}).update({"runAsUser": NON_ROOT, "runAsGroup": NON_ROOT})
            (manager,) = [c for c in pod["containers"] if c["name"] == "manager"]
            manager["image"] = image
            manager["imagePullPolicy"] = "IfNotPresent"
            manager["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}}
        out.append(doc)
    if not found:
        raise SystemExit(f"lws_manifests.py: no Deployment {CONTROLLER} in the manifests on stdin")
    return out


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: kubectl kustomize <lws>/config/default | lws_manifests.py IMAGE")
    yaml.safe_dump_all(fit_for_kind(yaml.safe_load_all(sys.stdin), sys.argv[1]), sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()

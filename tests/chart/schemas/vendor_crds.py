"""Writes the CRD schemas the chart tests validate against, from upstream CRD files (run by hand, not by tests).

    python tests/chart/schemas/vendor_crds.py ISVC_CRD.yaml SERVICEMONITOR_CRD.yaml [SCALEDOBJECT_CRD.yaml]

Each output is the CRD version's openAPIV3Schema with descriptions dropped; the InferenceService schema keeps only
the predictor fields a chart may set (the full one is ~2 MB, mostly PodSpec copies for other components).
README.md in this folder names the upstream files and commits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent
PREDICTOR_FIELDS = {
    "annotations", "labels", "minReplicas", "maxReplicas", "model", "nodeSelector", "tolerations", "affinity",
    "serviceAccountName", "terminationGracePeriodSeconds", "volumes", "imagePullSecrets", "securityContext",
    "scaleMetric", "scaleTarget", "deploymentStrategy", "timeout", "priorityClassName",
}


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def schema(crd_path: str, version: str) -> dict:
    crd = yaml.safe_load(Path(crd_path).read_text())
    (found,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return strip(found["schema"]["openAPIV3Schema"])


def main(isvc_crd: str, servicemonitor_crd: str, scaledobject_crd: str | None = None) -> None:
    isvc = schema(isvc_crd, "v1beta1")
    spec = isvc["properties"]["spec"]
    predictor = spec["properties"]["predictor"]
    predictor["properties"] = {k: v for k, v in predictor["properties"].items() if k in PREDICTOR_FIELDS}
    spec["properties"] = {"predictor": predictor}
    isvc["properties"].pop("status", None)
    out = {"serving.kserve.io/v1beta1/InferenceService": isvc,
           "monitoring.coreos.com/v1/ServiceMonitor": schema(servicemonitor_crd, "v1")}
    if scaledobject_crd is not None:
        scaled = schema(scaledobject_crd, "v1alpha1")
        scaled["properties"].pop("status", None)
        out["keda.sh/v1alpha1/ScaledObject"] = scaled
    for name, body in out.items():
        group, version, kind = name.split("/")
        (HERE / f"{kind.lower()}-{group}-{version}.json").write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])

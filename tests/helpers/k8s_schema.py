"""Validation of manifests against the official Kubernetes client's models (`kubernetes`
package, generated from the Kubernetes OpenAPI spec; pydantic models that forbid unknown
keys, check types strictly and require required fields): a typo or a wrong type fails."""

from __future__ import annotations

import kubernetes.client as k8s
from pydantic import ValidationError

KINDS = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service",
         ("v1", "ConfigMap"): "V1ConfigMap", ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
         ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2HorizontalPodAutoscaler",
         ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget"}


def validate(doc: dict) -> list[str]:
    """Problems found in one manifest; [] when it is valid."""
    model = KINDS.get((doc.get("apiVersion"), doc.get("kind")))
    if model is None:
        return [f"unknown apiVersion/kind {doc.get('apiVersion')}/{doc.get('kind')}"]
    try:
        getattr(k8s, model).model_validate(doc)
    except ValidationError as e:
        return [f"{doc['kind']}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
    return []

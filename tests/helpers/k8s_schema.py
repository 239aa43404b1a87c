"""Validation of manifests against the official Kubernetes client's models (`kubernetes`
package, generated from the Kubernetes OpenAPI spec; pydantic models that forbid unknown
keys, check types strictly and require required fields): a typo or a wrong type fails.

A LeaderWorkerSet (a custom resource the client has no model for) is checked against its
CRD's schema (tests/helpers/lws_schema.json, vendored from kubernetes-sigs/lws), strictly
(unknown keys fail, as `kubectl apply --validate=strict` does), and its pod templates
against the client's V1PodTemplateSpec."""

from __future__ import annotations

import json
import os

import jsonschema
import kubernetes.client as k8s
from pydantic import ValidationError

LWS_SCHEMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lws_schema.json")

KINDS = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service",
         ("v1", "ConfigMap"): "V1ConfigMap", ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
         ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2HorizontalPodAutoscaler",
         ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget"}


def validate(doc: dict) -> list[str]:
    """Problems found in one manifest; [] when it is valid."""
    if (doc.get("apiVersion"), doc.get("kind")) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"):
        return _validate_lws(doc)
    model = KINDS.get((doc.get("apiVersion"), doc.get("kind")))
    if model is None:
        return [f"unknown apiVersion/kind {doc.get('apiVersion')}/{doc.get('kind')}"]
    try:
        getattr(k8s, model).model_validate(doc)
    except ValidationError as e:
        return [f"{doc['kind']}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
    return []


def _validate_lws(doc: dict) -> list[str]:
    with open(LWS_SCHEMA) as f:
        schema = json.load(f)
    problems = [f"LeaderWorkerSet.{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
                for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    problems += _unknown_keys(doc, schema, "LeaderWorkerSet")
    lwt = doc.get("spec", {}).get("leaderWorkerTemplate", {})
    for name in ("leaderTemplate", "workerTemplate"):
        if name in lwt:
            try:
                k8s.V1PodTemplateSpec.model_validate(lwt[name])
            except ValidationError as e:
                problems += [f"LeaderWorkerSet.{name}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                             for err in e.errors()]
    return problems


def _unknown_keys(value, schema: dict, path: str) -> list[str]:
    """Keys the schema does not declare (it declares all of the LeaderWorkerSet's own)."""
    if isinstance(value, list) and "items" in schema:
        return [p for i, v in enumerate(value) for p in _unknown_keys(v, schema["items"], f"{path}[{i}]")]
    if not isinstance(value, dict) or "properties" not in schema:
        return []
    props = schema["properties"]
    return [f"{path}.{k}: not a field of the LeaderWorkerSet schema" for k in value if k not in props] + [
        p for k, v in value.items() if k in props for p in _unknown_keys(v, props[k], f"{path}.{k}")]

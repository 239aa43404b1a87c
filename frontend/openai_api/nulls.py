"""An explicit JSON `null` for an optional field means "not given": the field's default.

That is what OpenAI's API and vLLM accept, and what clients send: the official
openai-python client sends `null` for an argument passed as `None`, and many clients
write every field they know, null where unset. Request models derive from
NullMeansDefault: before validation, a null is dropped for each field that has a default
(a null for a field whose default is None already is that default), so the field takes
its default and strict validation still refuses a wrong type. A required field (`model`,
`messages`, `prompt`, `input`) stays required: its null is a 400 naming it. The declared
JSON schema (/openapi.json) says so too: such a field also accepts null.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic import BaseModel, model_validator


@lru_cache(maxsize=None)
def _defaulted(cls: type[BaseModel]) -> frozenset[str]:
    """The keys (aliases where set) of `cls`'s fields whose default is not None."""
    keys = set()
    for name, field in cls.model_fields.items():
        if field.is_required() or (field.default_factory is None and field.default is None):
            continue
        keys.add(field.alias or name)
        keys.add(name)
    return frozenset(keys)


def _accepts_null(schema: dict) -> bool:
    if schema.get("type") == "null" or schema.get("const", ...) is None:
        return True
    return any(_accepts_null(s) for s in schema.get("anyOf", []) + schema.get("oneOf", []) if isinstance(s, dict))


# Annotations of the property itself, not of the value's type: they stay outside anyOf.
_ANNOTATIONS = ("title", "description", "default", "examples", "deprecated")


class NullMeansDefault(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            keys = _defaulted(cls)
            if any(v is None and k in keys for k, v in data.items()):
                data = {k: v for k, v in data.items() if not (v is None and k in keys)}
        return data

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        json_schema = handler(core_schema)
        target = handler.resolve_ref_schema(json_schema)
        properties = target.get("properties", {})
        keys = _defaulted(cls)
        for key, prop in list(properties.items()):
            if key in keys and isinstance(prop, dict) and not _accepts_null(prop):
                outer = {k: prop[k] for k in _ANNOTATIONS if k in prop}
                inner = {k: v for k, v in prop.items() if k not in _ANNOTATIONS}
                properties[key] = {"anyOf": [inner, {"type": "null"}], **outer}
        return json_schema

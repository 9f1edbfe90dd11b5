"""Structured outputs at the gateway: OpenAI's response_format, vLLM's structured_outputs and its
legacy guided_* fields -> one StructuredOutputsParams, checked before any engine sees it."""
from __future__ import annotations

import json

from engine.request import InvalidRequestError
from engine.structured_output.params import StructuredOutputsParams

from services.router.errors import bad_request

LEGACY_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
FIELDS = {"response_format", "structured_outputs", "guided_decoding_backend", *LEGACY_FIELDS}
_KIND_KEYS = {"json", "json_object", "regex", "choice", "grammar"}
_VLLM_KEYS = _KIND_KEYS | {"backend", "disable_any_whitespace"}


def parse_structured_outputs(body: dict, tool_schema: str | None = None) -> StructuredOutputsParams | None:
    """The one constraint the body asks for (None: free text); more than one source is a 400.
    tool_schema: the JSON schema tool_choice "required" or a named function generates under.
    A structured_outputs object with options only (backend, disable_any_whitespace) applies them
    to the constraint given elsewhere."""
    so = body.get("structured_outputs")
    options = {}
    if isinstance(so, dict) and not set(so) & _KIND_KEYS:
        so, options = None, _vllm(so)
    sources = [name for name in ("response_format", "structured_outputs", *LEGACY_FIELDS)
               if (so if name == "structured_outputs" else body.get(name)) is not None
               and not (name == "response_format" and _is_text(body[name]))]
    if tool_schema is not None:
        sources.append("tool_choice")
    if len(sources) > 1:
        raise bad_request(f"only one structured output constraint may be given; got {', '.join(sources)}",
                          sources[1])
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise bad_request("guided_decoding_backend must be a string", "guided_decoding_backend")
    if not sources:
        return None
    source = sources[0]
    if source == "tool_choice":
        kwargs = {"json": tool_schema}
    elif source == "response_format":
        kwargs = _response_format(body[source])
    elif source == "structured_outputs":
        kwargs = _vllm(so)
    else:
        kind = source.removeprefix("guided_")
        kwargs = {kind: _json_text(body[source], source) if kind == "json" else body[source]}
    kwargs = {**options, **kwargs}
    if backend and "backend" not in kwargs:
        kwargs["backend"] = backend
    return build(kwargs, source)


def build(kwargs: dict, param: str) -> StructuredOutputsParams:
    """StructuredOutputsParams from keyword arguments, with its checks as 400s on `param`."""
    try:
        params = StructuredOutputsParams(**kwargs)
    except InvalidRequestError as e:
        raise bad_request(str(e), param) from None
    except TypeError as e:  # a value of the wrong type
        raise bad_request(f"{param}: {e}", param) from None
    check(params, param)
    return params


def check(params: StructuredOutputsParams, param: str) -> None:
    """What can be checked without the model's tokenizer: a JSON schema against the JSON Schema
    meta-schema, a regex (and, for llguidance, a grammar) by llguidance's parser. The engine's
    compile is the last word: what fails there is still a 400."""
    kind = params.kind
    if kind == "json":
        import jsonschema

        schema = json.loads(params.json)  # parsed already by StructuredOutputsParams
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            raise bad_request(f"{param}: invalid JSON schema: {e.message}", param) from None
    if kind == "regex" or (kind == "grammar" and params.resolved_backend == "llguidance"):
        import llguidance

        try:
            error = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from(kind, params.spec))
        except ValueError as e:
            error = str(e)
        if error:
            raise bad_request(f"{param}: invalid {kind}: {_error_line(error)}", param)


def _error_line(error: str) -> str:
    """llguidance's message, whose telling line may follow a caret drawing: the `error:` one."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    return next((ln.removeprefix("error: ") for ln in lines if ln.startswith("error:")), lines[0] if lines else error)


def _is_text(response_format) -> bool:
    return isinstance(response_format, dict) and response_format.get("type") == "text"


def _response_format(rf) -> dict:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request("response_format must be an object with a type", "response_format")
    kind = rf["type"]
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a schema", "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format")
        if "strict" in spec and not isinstance(spec["strict"], bool):
            raise bad_request("response_format.json_schema.strict must be a boolean", "response_format")
        # Every document is generated by the grammar: strict or not, the output matches the schema.
        return {"json": _json_text(schema, "response_format")}
    raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                      "response_format")


def _vllm(so) -> dict:
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(so) - _VLLM_KEYS)
    if unknown:
        raise bad_request(f"structured_outputs has unknown fields: {', '.join(unknown)}", "structured_outputs")
    kwargs = {k: v for k, v in so.items() if v is not None}
    if "json" in kwargs:
        kwargs["json"] = _json_text(kwargs["json"], "structured_outputs")
    return kwargs


def _json_text(schema, param: str) -> str:
    """A schema sent as an object or as JSON text -> JSON text."""
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param}: a JSON schema must be an object", param)
    return json.dumps(schema)

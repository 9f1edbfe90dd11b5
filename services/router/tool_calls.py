"""Tool calling on /v1/chat/completions: tools + tool_choice -> a constraint or a parser, and the
generated text -> OpenAI tool_calls.

tool_choice "required" or a named function: the output is generated under a JSON schema (the
function's parameters, or an array of {"name", "arguments"} calls), so it always parses.
"auto": the tools go to the chat template (apply_chat_template(tools=...)) and the output is read
by the router's --tool-call-parser (vLLM's names):
- `hermes` (the default; Hermes, Qwen): each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  block is a call, the text outside them is the message's content;
- `llama3_json` (Llama 3.1-3.3): an output that is JSON objects `{"name": ..., "parameters": {...}}`
  (or "arguments"), one or several joined by `;`, is calls; any other output is content;
- `pythonic` (Llama 3.2, Llama 4): an output that is a Python list of calls with keyword
  arguments of literals, `[get_weather(city="Paris"), now()]`, is calls; any other is content;
- `mistral` (Mistral, Ministral, Devstral, Magistral with their Hugging Face tokenizers): the
  output from `[TOOL_CALLS]` on is calls, `name[ARGS]{...}` per `[TOOL_CALLS]` (tokenizer v11 and
  later) or one JSON array of `{"name", "arguments"}` (earlier); the text before it is content.
  `[TOOL_CALLS]` is a special token there, so such requests keep special tokens in their text.
- `qwen3_coder` (Qwen3-Coder, Qwen3.5): `<tool_call><function=NAME><parameter=KEY>value
  </parameter>...</function></tool_call>` blocks (or, from a `<function=NAME>` naming one of the
  request's tools before any `<tool_call>`, bare `<function=...>...</function>` calls, as vLLM
  reads an output without blocks); `glm45` (GLM-4.5 to 4.7):
  `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value</arg_value>...</tool_call>`. Their values
  are text: each is read as its parameter's JSON schema type (integer, number, boolean, object,
  array, null; a string, or a parameter without a type, stays text).
- `deepseek_v3` (DeepSeek-V3, R1-0528): `<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the arguments in a ```json fence;
  `deepseek_v31` (DeepSeek-V3.1 and later): `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}`;
  `kimi_k2` (Kimi K2): `<|tool_calls_section_begin|>` then per call
  `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{...}<|tool_call_end|>`, the
  header being the call's id (Kimi's templates take it back). Their markers are special tokens
  in some of these tokenizers: requests with tools keep special tokens in their text.
  Under these five, the text before the first call is content, a call that does not parse is
  left out, and an output with none is all content.
"""
from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass, field, replace
from functools import cache, cached_property

from services.router.errors import bad_request

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
QWEN_FUNCTION_OPEN, QWEN_FUNCTION_CLOSE = "<function=", "</function>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S)
_NO_PARAMETERS = {"type": "object", "properties": {}}


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder", "glm45", "deepseek_v3",
                     "deepseek_v31", "kimi_k2")
MISTRAL_TAG, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
DEEPSEEK_CALLS, DEEPSEEK_CALL, DEEPSEEK_SEP, DEEPSEEK_CALL_END = (
    "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")
KIMI_SECTION, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = (
    "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
# Parsers whose calls follow an opening tag, the content before it: the tag a stream holds back at.
_TAGGED = {"hermes": TOOL_CALL_OPEN, "mistral": MISTRAL_TAG, "qwen3_coder": TOOL_CALL_OPEN, "glm45": TOOL_CALL_OPEN,
           "deepseek_v3": DEEPSEEK_CALLS, "deepseek_v31": DEEPSEEK_CALLS, "kimi_k2": KIMI_SECTION}
# Parsers whose markers are special tokens in their models' tokenizers (some of them): a request
# with tools keeps special tokens in its text, as vLLM's parsers for them ask.
KEEPS_SPECIAL_TOKENS = frozenset({"mistral", "deepseek_v3", "deepseek_v31", "kimi_k2"})
# Parsers whose argument values are text, read by the tools' parameter schemas.
_TYPED = frozenset({"qwen3_coder", "glm45"})
# What a whole-output parser's calls may begin with (after whitespace and the model's special
# tag, which detokenization usually drops): until an output shows it does or does not, it is held.
_OPENERS = {"llama3_json": ("<|python_tag|>", "{"), "pythonic": ("<|python_start|>", "[")}


def check_tool_call_parser(name: str) -> str:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown --tool-call-parser {name!r}; choose {', '.join(TOOL_CALL_PARSERS)}")
    return name


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    tools: tuple  # the request's tools, for the chat template
    name: str | None = None  # mode "named": the function
    parser: str = "hermes"  # mode "auto": how the output is read (--tool-call-parser)

    @cached_property
    def names(self) -> frozenset:
        """The offered functions' names (read once a request)."""
        return tool_names(self.tools)

    @property
    def constrained(self) -> bool:
        return self.mode != "auto"

    def schema(self, parallel: bool) -> str | None:
        """The JSON schema the output is generated under (None for auto)."""
        if self.mode == "auto":
            return None
        functions = {t["function"]["name"]: t["function"].get("parameters") or _NO_PARAMETERS for t in self.tools}
        if self.mode == "named":
            schema = functions[self.name]
        else:
            call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                               "required": ["name", "arguments"], "additionalProperties": False}
                              for name, params in functions.items()]}
            schema = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return json.dumps(schema)

    def tool_calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) from a finished output. A constrained output that does not parse
        (cut off by max_tokens) stays content, with no calls."""
        if self.mode == "named":
            try:
                json.loads(text)
            except ValueError:
                return text, []
            return None, [make_call(self.name, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except ValueError:
                return text, []
            return None, [make_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
        return parse_auto(self.parser, text, self.tools)


def parse_tools(body: dict, parser: str = "hermes", auto: bool = True) -> ToolPlan | None:
    """None when the request has no tools or tool_choice is "none" (the output is plain content).
    `parser`: how an "auto" answer is read (--tool-call-parser); `auto` False: the router runs
    with --no-enable-auto-tool-choice, and "auto" (the default with tools) is a 400, as vLLM
    answers without --enable-auto-tool-choice."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", "tools")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise bad_request("tools has two functions of the same name", "tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or not tools and choice == "auto":
        return None
    if choice in ("auto", "required"):
        if not tools:
            raise bad_request(f"tool_choice {choice!r} needs at least one tool", "tool_choice")
        if choice == "auto" and not auto:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice (this router runs with '
                              '--no-enable-auto-tool-choice): send tool_choice "required", "none" or a named '
                              "function", "tool_choice")
        return ToolPlan(choice, tuple(tools), parser=parser)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                              '"function": {"name": ...}}', "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan("named", tuple(tools), name)
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                      '"function": {"name": ...}}', "tool_choice")


def make_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


_ALNUM = string.ascii_letters + string.digits


def mistral_call_id(given: str | None = None) -> str:
    """Mistral's chat templates refuse a tool call id that is not 9 letters or digits (the id
    comes back with the tool's result): the model's own when it wrote one, else a fresh one."""
    if given is not None and len(given) == 9 and given.isascii() and given.isalnum():
        return given
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """Hermes / Qwen tool calls: `<tool_call>{"name": .., "arguments": {..}}</tool_call>` blocks
    (a last one left open at the end counts). A block that is not such JSON stays in the content."""
    if TOOL_CALL_OPEN not in text:
        return text, []
    calls, kept, at = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            call = json.loads(m.group(1))
            name, arguments = call["name"], _arguments(call.get("arguments", call.get("parameters")))
            if not isinstance(name, str) or arguments is None:
                raise TypeError
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append(make_call(name, arguments))
    kept.append(text[at:])
    content = "".join(kept).strip()
    return (content or None), calls


def _strip_tag(text: str, tag: str) -> str:
    text = text.strip()
    return text[len(tag):].strip() if text.startswith(tag) else text


def _call_keys_once(pairs: list) -> bool:
    """A call object's keys (its top level, as pairs): `name`, `arguments` and `parameters` once
    each at most, and not both of the last two (an object that says two things is no call: JSON
    readers disagree on which)."""
    keys = [k for k, _ in pairs]
    return keys.count("name") <= 1 and not ("arguments" in keys and "parameters" in keys) \
        and keys.count("arguments") <= 1 and keys.count("parameters") <= 1


_PAIRS = json.JSONDecoder(object_pairs_hook=lambda pairs: pairs)


def _arguments(value) -> str | None:
    """A call's arguments as JSON text: an object's (or a string holding one, as written); null
    for none (`{}`); None for anything else (then it is no call, the stream's rule too: OpenAI's
    arguments are an object's JSON, and a client passes them as keyword arguments)."""
    if value is None:
        return "{}"
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return value if isinstance(value, str) and arguments_object(value) is not None else None


def parse_llama3_json(text: str) -> tuple[str | None, list[dict]]:
    """Llama 3's JSON tool calls: the whole output (past `<|python_tag|>`) is one or more
    `{"name": ..., "parameters" | "arguments": ...}` objects joined by `;`; else it is content."""
    s = _strip_tag(text, "<|python_tag|>")
    if not s.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(s):
        try:
            start = at
            obj, at = decoder.raw_decode(s, at)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or \
                not ("parameters" in obj or "arguments" in obj) or not _call_keys_once(_PAIRS.raw_decode(s, start)[0]):
            return text, []
        arguments = _arguments(obj["parameters"] if "parameters" in obj else obj["arguments"])
        if arguments is None:
            return text, []
        calls.append(make_call(obj["name"], arguments))
        rest = s[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return text, []
        at = len(s) - len(rest)
    return None, calls


def parse_pythonic(text: str) -> tuple[str | None, list[dict]]:
    """Pythonic tool calls (Llama 3.2, Llama 4): the whole output (past `<|python_start|>`, up to
    `<|python_end|>`) is a Python list of calls with keyword arguments of literals; else content."""
    s = _strip_tag(text, "<|python_start|>")
    s = s[:-len("<|python_end|>")].strip() if s.endswith("<|python_end|>") else s
    if not s.startswith("["):
        return text, []
    try:
        tree = ast.parse(s, mode="eval").body
        if not isinstance(tree, ast.List):
            return text, []
        calls = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args or \
                    any(kw.arg is None for kw in call.keywords):
                return text, []
            args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
            calls.append(make_call(call.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return text, []  # not Python, not literals, or not JSON (bytes, sets)
    return None, calls


def parse_mistral(text: str) -> tuple[str | None, list[dict]]:
    """Mistral's tool calls: from the first `[TOOL_CALLS]`, each `[TOOL_CALLS]name[ARGS]{...}`
    (a `[CALL_ID]id` after the name is its id), or one `[TOOL_CALLS][{"name", "arguments"}, ...]`
    array (an `"id"` is the call's; streamed, the calls of an array take the stream's ids, their
    heads going out before their ids are written); the text before is content. Any part that does not parse leaves the whole output as
    content (vLLM's rule)."""
    at = text.find(MISTRAL_TAG)
    if at < 0:
        return text, []
    calls = []
    for part in text[at:].split(MISTRAL_TAG)[1:]:
        part = part.strip()
        if not part:
            continue
        try:
            if part.startswith("["):  # before tokenizer v11: a JSON array of calls
                array, end = json.JSONDecoder().raw_decode(part)
                if part[end:].strip() or not isinstance(array, list):
                    return text, []
                pairs = _PAIRS.raw_decode(part)[0]
                if not all(isinstance(p, list) and _call_keys_once(p) for p in pairs):
                    return text, []
                for call in array:
                    name, arguments = call["name"], _arguments(call.get("arguments", call.get("parameters")))
                    if not isinstance(name, str) or arguments is None:
                        return text, []
                    calls.append(make_call(name, arguments, mistral_call_id(call.get("id"))))
                continue
            name, sep, arguments = part.partition(MISTRAL_ARGS)
            name, _, given_id = name.partition("[CALL_ID]")
            name = name.strip()
            value, end = json.JSONDecoder().raw_decode(arguments.strip())
            if not sep or not name or arguments.strip()[end:].strip() or not isinstance(value, dict):
                return text, []
            calls.append(make_call(name, json.dumps(value, ensure_ascii=False),
                                   mistral_call_id(given_id.strip() or None)))
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []
    if not calls:
        return text, []
    content = text[:at].strip()
    return (content or None), calls


def _schema_types(schema) -> list[str]:
    """The JSON types a parameter's schema allows: `type` (one or a list), its enum values' types,
    and those of anyOf / oneOf / allOf; none known: []."""
    if not isinstance(schema, dict):
        return []
    kinds = schema.get("type")
    types = [kinds] if isinstance(kinds, str) else [t for t in kinds if isinstance(t, str)] \
        if isinstance(kinds, list) else []
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
             type(None): "null"}
    for value in schema.get("enum") or () if isinstance(schema.get("enum"), list) else ():
        types.append(names.get(type(value), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or () if isinstance(schema.get(key), list) else ():
            types += _schema_types(sub)
    return types


def _finite(value) -> bool:
    """No NaN or infinity anywhere (JSON has none)."""
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def typed_value(text: str, schema):
    """A parameter's value written as text, read as its schema's type: null, then integer,
    number, boolean, object, array, in that order, the first that reads; otherwise (a string, no
    type, or nothing reads) the text."""
    types = set(_schema_types(schema))
    s = text.strip()
    if "null" in types and s.lower() == "null":
        return None
    if "integer" in types and re.fullmatch(r"[-+]?\d+", s):
        return int(s)
    if "number" in types and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", s):
        number = float(s)
        if _finite(number):
            return int(number) if number.is_integer() and re.fullmatch(r"[-+]?\d+", s) else number
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    for kind, cls in (("object", dict), ("array", list)):
        if kind in types:
            try:
                value = json.loads(s)
            except ValueError:
                continue
            if isinstance(value, cls) and _finite(value):
                return value
    return text


def _properties(tools, name: str) -> dict:
    for tool in tools:
        fn = tool.get("function") or {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def _one_newline_off(value: str) -> str:
    """A value between tags, less the one newline each side the templates write around it."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed_call(tools, name: str, pairs: list[tuple[str, str]]) -> dict:
    props = _properties(tools, name)
    args = {key: typed_value(value, props.get(key)) for key, value in pairs}
    return make_call(name, json.dumps(args, ensure_ascii=False))


def _calls_after(text: str, opener: str, separator: str, parse_one) -> tuple[str | None, list[dict]]:
    """Calls after the first `opener`, each beginning with `separator` (the opener itself for
    Qwen's and GLM's blocks, the call marker inside DeepSeek's and Kimi's section); the last may
    be cut off. The text before is content; `parse_one(body)` -> a call, or None (left out). No
    call at all: the output is content."""
    at = text.find(opener)
    if at < 0:
        return text, []
    body = text[at:] if opener == separator else text[at + len(opener):]
    calls = [call for call in (parse_one(part) for part in body.split(separator)[1:]) if call is not None]
    if not calls:
        return text, []
    return (text[:at].strip() or None), calls


_QWEN_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
# A value ends at its closing tag, or where the next parameter or the function's end begins; one
# cut off by the end of the output is no value (the call keeps the parameters it finished).
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>))", re.S)


def parse_qwen3_coder(text: str, tools=()) -> tuple[str | None, list[dict]]:
    """Qwen3-Coder's XML calls: `<tool_call><function=NAME><parameter=KEY>value</parameter>...
    </function></tool_call>`; values read by the parameters' schema types."""
    def one(block: str, bare: bool = False) -> dict | None:
        m = _QWEN_FUNCTION.search(block if bare else block.split(TOOL_CALL_CLOSE, 1)[0])
        if m is None or not m.group(1).strip():
            return None
        # A value whose </parameter> is missing ends at </function> (kept there: a closed function).
        body = m.group(2) + ("</function>" if m.group(0).endswith("</function>") else "")
        pairs = [(k.strip(), _one_newline_off(v)) for k, v in _QWEN_PARAMETER.findall(body)]
        return _typed_call(tools, m.group(1).strip(), pairs)
    first = text.find(TOOL_CALL_OPEN)
    at = text.find(QWEN_FUNCTION_OPEN, 0, first if first >= 0 else len(text))
    names = tool_names(tools)
    while at >= 0 and not _qwen_bare_call(text, at, names):
        at = text.find(QWEN_FUNCTION_OPEN, at + 1, first if first >= 0 else len(text))
    if at < 0:
        return _calls_after(text, TOOL_CALL_OPEN, TOOL_CALL_OPEN, one)
    parts = text[at:].split(QWEN_FUNCTION_OPEN)[1:]  # each ends where the next opens (as a stream reads them)
    calls = [one(QWEN_FUNCTION_OPEN + part + (QWEN_FUNCTION_CLOSE if i + 1 < len(parts) else ""), bare=True)
             for i, part in enumerate(parts)]
    calls = [call for call in calls if call is not None]
    return ((text[:at].strip() or None), calls) if calls else (text, [])


def tool_names(tools) -> frozenset:
    """The names of a request's functions."""
    return frozenset(t["function"]["name"] for t in tools if isinstance(t.get("function"), dict))


def _qwen_bare_call(text: str, at: int, names: frozenset) -> bool | None:
    """Whether the `<function=` at `at`, before any `<tool_call>`, opens a Qwen3-Coder call written
    without its block: its name is one of the request's tools (`names`; prose that writes the tag
    names none, as a rule); None: its name is not out yet."""
    start = at + len(QWEN_FUNCTION_OPEN)
    longest = max(map(len, names), default=0) + 2
    gt = text.find(">", start, start + longest + 1)
    if gt < 0:
        return None if len(text) - start <= longest and "\n" not in text[start:] else False
    return "\n" not in text[start:gt] and text[start:gt].strip() in names  # (no newline: as the whole parse reads names)


_GLM_ARG = re.compile(r"<arg_key>([^<]*)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)  # a key is no markup


def parse_glm45(text: str, tools=()) -> tuple[str | None, list[dict]]:
    """GLM-4.5's calls: `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value</arg_value>...
    </tool_call>` (a newline may follow the name and each pair); values read by the schema types."""
    def one(block: str) -> dict | None:
        body = block.split(TOOL_CALL_CLOSE, 1)[0]
        name = body.split("<arg_key>", 1)[0].strip()
        if not name or "<" in name or "\n" in name:
            return None
        return _typed_call(tools, name, [(k.strip(), v) for k, v in _GLM_ARG.findall(body)])
    return _calls_after(text, TOOL_CALL_OPEN, TOOL_CALL_OPEN, one)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant)  # NaN and Infinity are Python's, not JSON's


def _json_object(text: str) -> str | None:
    """The arguments as JSON text when they are one JSON object (and nothing after it), else None."""
    try:
        value, end = _STRICT_JSON.raw_decode(text.strip())
    except ValueError:
        return None
    if not isinstance(value, dict) or text.strip()[end:].strip():
        return None
    return json.dumps(value, ensure_ascii=False)


def parse_deepseek_v3(text: str) -> tuple[str | None, list[dict]]:
    """DeepSeek-V3's calls: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
    <｜tool▁call▁end｜>` after `<｜tool▁calls▁begin｜>`."""
    def one(part: str) -> dict | None:
        _, sep, rest = part.split(DEEPSEEK_CALL_END, 1)[0].partition(DEEPSEEK_SEP)
        name, _, fenced = rest.partition("\n")
        m = re.fullmatch(r"\s*```(?:json)?\s*(.*?)\s*(?:```)?\s*", fenced, re.S)
        arguments = _json_object(m.group(1)) if m else None
        return make_call(name.strip(), arguments) if sep and name.strip() and arguments is not None else None
    return _calls_after(text, DEEPSEEK_CALLS, DEEPSEEK_CALL, one)


def parse_deepseek_v31(text: str) -> tuple[str | None, list[dict]]:
    """DeepSeek-V3.1's calls: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""
    def one(part: str) -> dict | None:
        name, sep, rest = part.split(DEEPSEEK_CALL_END, 1)[0].partition(DEEPSEEK_SEP)
        arguments = _json_object(rest)
        return make_call(name.strip(), arguments) if sep and name.strip() and arguments is not None else None
    return _calls_after(text, DEEPSEEK_CALLS, DEEPSEEK_CALL, one)


def parse_kimi_k2(text: str) -> tuple[str | None, list[dict]]:
    """Kimi K2's calls: `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{...}
    <|tool_call_end|>` after `<|tool_calls_section_begin|>`; the header is the call's id."""
    def one(part: str) -> dict | None:
        header, sep, rest = part.split(KIMI_CALL_END, 1)[0].partition(KIMI_ARGS)
        header = header.strip()
        m = re.fullmatch(r"(?:functions\.)?(.+):\d+", header)
        arguments = _json_object(rest)
        if not sep or m is None or arguments is None:
            return None
        return make_call(m.group(1), arguments, header)
    return _calls_after(text, KIMI_SECTION, KIMI_CALL, one)


PARSE = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "pythonic": parse_pythonic,
         "mistral": parse_mistral, "qwen3_coder": parse_qwen3_coder, "glm45": parse_glm45,
         "deepseek_v3": parse_deepseek_v3, "deepseek_v31": parse_deepseek_v31, "kimi_k2": parse_kimi_k2}


def parse_auto(parser: str, text: str, tools=()) -> tuple[str | None, list[dict]]:
    """(content, calls) of an answer to tool_choice "auto" under `parser`."""
    return PARSE[parser](text, tools) if parser in _TYPED else PARSE[parser](text)


# A Hermes block's head, up to its arguments object: from here the arguments stream as written.
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)',
                          re.S)


def _json_string(body: str) -> str | None:
    """A JSON string's value from the text between its quotes (None: not a valid one)."""
    try:
        return json.loads(f'"{body}"')
    except ValueError:
        return None


def arguments_object(text: str) -> dict | None:
    """A call's arguments as a mapping when they are a JSON object, else None (as Python reads JSON)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def _is_json_object(text: str, strict: bool = True) -> bool:
    try:
        return isinstance((_STRICT_JSON.decode if strict else json.loads)(text), dict)
    except ValueError:
        return False


# What the output may end in when it is cut off inside a call's head: Mistral v11's NAME, maybe
# [CALL_ID]ID and [ARGS] (or a piece of those markers), nothing after it; a pythonic call's name
# (then its parenthesis, its arguments).
_MISTRAL_HEAD_SO_FAR = re.compile(r"[\w.\-]*(?:\[CALL_ID\][\w.\-]*)?(?:\[[A-Z_]*\]?)?")
_PYTHON_CALL_SO_FAR = re.compile(r"\s*[A-Za-z_]\w*\s*(?:\(|$)")


@cache
def _calls_markup(separator: str, bracket: bool, end_tag: str) -> re.Pattern:
    return re.compile(r"\s*(?:%s\s*)?%s%s" % (re.escape(separator), r"(?:\]\s*)?" if bracket else "",
                                            r"(?:%s\s*)?" % re.escape(end_tag) if end_tag else ""))


def _after_calls(text: str, separator: str, bracket: bool, end_tag: str = "") -> str:
    """The text after a sequence's last call, as content: a separator, then an array's or list's
    closing bracket and the model's end tag, right after the call, are the calls' markup (the
    whitespace before what follows is kept)."""
    markup = _calls_markup(separator, bracket, end_tag).match(text)
    rest = text[markup.end():].rstrip()
    if end_tag and rest.endswith(end_tag):
        rest = rest[:-len(end_tag)].rstrip()
    if not rest:
        return ""
    lead = text[:markup.end()]
    return lead[len(lead.rstrip()):] + rest


def _tag_start_at_end(text: str, tag: str) -> int:
    """How many characters at the text's end may be the start of `tag` (0: none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _brace_after(*markups: str):
    """`opens(text, read, end, start)`: whether a `{` in text[read:end] follows one of `markups`
    (past whitespace, not before `start`): where a head's pattern can end. Each `{` looks back
    over the whitespace right before it only: linear in all."""
    def follows(text: str, at: int, start: int) -> bool:
        q = at
        while q > start and text[q - 1].isspace():
            q -= 1
        return any(text.startswith(m, q - len(m)) and q - len(m) >= start for m in markups)

    def opens(text: str, read: int, end: int, start: int) -> bool:
        at = text.find("{", read, end)
        while at >= 0 and not follows(text, at, start):
            at = text.find("{", at + 1, end)
        return at >= 0
    return opens


def _brace_head(pattern: re.Pattern, named, opens):
    """Heads read by a pattern that ends right before the arguments' `{` (Hermes, DeepSeek-V3):
    one can only come out with a `{` the text read before did not have, and only one after the
    markup the pattern ends in (`opens`, from _brace_after: Hermes' `:`, DeepSeek-V3's fence), so
    each feed looks for such a `{` in what is new, and the pattern reads from past the whitespace
    before the head (a long run of whitespace, a long name, a name of braces, is not read again at
    every piece). A head not out within
    _LONGEST_HEAD characters of its first one that is not whitespace is read once more when its
    block closes (`closed`), not before: the same reading as the block's text fed whole.
    `named(match)`: the name, or None where the head is no call's."""
    def head(text: str, start: int, end: int, block: "_CallBlock",
             closed: bool = False) -> tuple[str, None, int] | None:
        read, block.head_from = max(start, block.head_from), end
        lead = block.lead_to = _SPACES.match(text, max(start, block.lead_to), end).end()
        if read - lead > _LONGEST_HEAD:
            if not closed:
                return None
        elif not opens(text, read, end, start):
            return None
        m = pattern.match(text, lead, end)
        name = named(m) if m is not None else None
        return (name, None, m.end()) if name is not None else None
    return head


# A Hermes block's head `{"name": ..., "arguments": `: (name, no id, where the arguments object
# starts), once it is out.
_hermes_head = _brace_head(_HERMES_HEAD, lambda m: _json_string(m.group(1)), _brace_after(":"))


def _sep_head(sep: str, header):
    """Heads that end at a separator, the arguments' JSON object after it (DeepSeek-V3.1: NAME then
    `<｜tool▁sep｜>`; Kimi K2: functions.NAME:N, its id, then `<|tool_call_argument_begin|>`).
    Such a head is out at its separator, however long: `closed` (the brace heads') changes
    nothing here."""
    def head(text: str, start: int, end: int, block: "_CallBlock",
             closed: bool = False) -> tuple[str, str | None, int] | None:
        # Each feed reads on from where the last stopped (a long header, or a long run of
        # whitespace after the separator, is read once, not again at every piece).
        at = block.head_from = text.find(sep, max(start, block.head_from), end)
        if at < 0:
            block.head_from = max(start, end - len(sep) + 1)
            return None
        args = block.args_from = _SPACES.match(text, max(at + len(sep), block.args_from), end).end()
        if args >= end or text[args] != "{":
            return None  # not yet out, or not an object (then no call: whole-output parsing agrees)
        named = header(text[start:at].strip())
        return (*named, args) if named is not None else None
    return head


_SPACES = re.compile(r"\s*")


def _kimi_header(header: str) -> tuple[str, str] | None:
    m = re.fullmatch(r"(?:functions\.)?(.+):\d+", header)
    return (m.group(1), header) if m is not None else None


# DeepSeek-V3's head: `function<｜tool▁sep｜>NAME` and a line later the fence its JSON is in.
_DEEPSEEK_V3_HEAD = re.compile(r"(?:(?!" + re.escape(DEEPSEEK_SEP) + r").)*" + re.escape(DEEPSEEK_SEP)
                               + r"([^\n]*)\n\s*```(?:json)?\s*(?=\{)", re.S)


_deepseek_v3_head = _brace_head(_DEEPSEEK_V3_HEAD, lambda m: m.group(1).strip() or None,
                                _brace_after("```", "```json"))


def _mistral_header(header: str) -> tuple[str, str] | None:
    """Mistral (tokenizer v11 on): NAME, or NAME[CALL_ID]ID, before `[ARGS]`."""
    name, _, given = header.partition("[CALL_ID]")
    name = name.strip()
    return (name, mistral_call_id(given.strip() or None)) if name and not set(name) & set("[]<>") else None


# Parsers whose calls' arguments are JSON objects streamed as written: (a call's opening marker,
# its closing marker, its head: (name, id or None, where the arguments start) once out).
_JSON_CALLS = {
    "hermes": (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, _hermes_head),
    "deepseek_v3": (DEEPSEEK_CALL, DEEPSEEK_CALL_END, _deepseek_v3_head),  # (the fence's end after the object)
    "deepseek_v31": (DEEPSEEK_CALL, DEEPSEEK_CALL_END,
                     _sep_head(DEEPSEEK_SEP, lambda h: (h, None) if h and "<" not in h else None)),
    "kimi_k2": (KIMI_CALL, KIMI_CALL_END, _sep_head(KIMI_ARGS, _kimi_header)),
    # Mistral, tokenizer v11 on: `[TOOL_CALLS]NAME[ARGS]{...}` per call, no closing marker (a call
    # ends where the next begins, or with the output).
    "mistral": (MISTRAL_TAG, None, _sep_head(MISTRAL_ARGS, _mistral_header)),
}


class _JsonScan:
    """How much of a text that starts with a JSON object belongs to that object, read a piece at a
    time: strings and escapes are followed, so braces inside them do not count."""

    def __init__(self) -> None:
        self.length = 0  # characters of the object so far
        self.closed = False
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, text: str, start: int, end: int) -> None:
        """Reads text[start:end], the characters after those read so far."""
        for i in range(start, end):
            if self.closed:
                return
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                self.closed = self._depth == 0
            self.length += 1


_LONGEST_HEAD = 4096  # characters of a call object before its arguments, at most, for the stream to follow it


@dataclass
class _ObjectSequence:
    """JSON call objects one after another, a separator between them (Llama 3: `;`; Mistral's
    array before tokenizer v11: `,` and a closing `]`): where the next one is looked for, the one
    being written (its whole object's scan beside its arguments'), and whether it stopped (the end,
    or something the stream cannot follow: the finish parses the output whole)."""
    pos: int
    separator: str
    block: _CallBlock | None = None
    outer: _JsonScan = field(default_factory=_JsonScan)
    bracket: bool = False  # a closing `]` ends the calls (Mistral's array)
    need_separator: bool = False
    stopped: bool = False
    calls_end: int = -1  # where the last call object read ends (-1: none yet)


class _PythonScan:
    """Python's brackets outside its strings, read a piece at a time: where each element of the
    outer list ends. A triple-quoted string may fool it; the call it cuts then does not parse and
    the stream stops (the finish parses the output whole)."""

    def __init__(self, pos: int) -> None:
        self.pos = pos  # characters read up to here
        self.depth = 0
        self.quote: str | None = None
        self.escaped = False
        self.element = -1  # where the element being read starts (-1: between elements)
        self.stopped = False
        self.calls_end = pos  # where the last call read ends (past the list's "[" before any)


_NOT_TEXT = frozenset({"null", "integer", "number", "boolean", "object", "array"})


def _qwen_bare_name(text: str, start: int, end: int, closed: bool) -> tuple[str, int] | None:
    """Qwen3-Coder without its `<tool_call>` blocks: NAME> right after `<function=`: (the name,
    where its parameters start), once out."""
    gt = text.find(">", start, end)
    name = text[start:gt] if gt >= 0 else ""
    return (name.strip(), gt + 1) if name.strip() and "\n" not in name else None


def _qwen_name(text: str, start: int, end: int, closed: bool) -> tuple[str, int] | None:
    """Qwen3-Coder: `<function=NAME>` in its block."""
    at = text.find(QWEN_FUNCTION_OPEN, start, end)
    return _qwen_bare_name(text, at + len(QWEN_FUNCTION_OPEN), end, closed) if at >= 0 else None


def _glm_name(text: str, start: int, end: int, closed: bool) -> tuple[str, int] | None:
    """GLM-4.5: the text before the first `<arg_key>` (or the whole block, closed without one)."""
    at = text.find("<arg_key>", start, end)
    if at < 0 and not closed:
        return None
    at = end if at < 0 else at
    name = text[start:at].strip()
    return (name, at) if name and "<" not in name and "\n" not in name else None


@dataclass(frozen=True)
class _XmlDialect:
    """How a format's XML calls write their name and parameters."""
    name: object  # (text, body start, end, closed) -> (name, where the parameters start) or None
    key_open: str
    key_close: str
    value_open: str  # "" when the value follows the key's tag
    value_ends: tuple[str, ...]  # where a value ends (its closing tag first)
    args_end: str | None  # where the parameters end, besides the block's close
    trim: bool  # one newline each side of a value is the template's

    @property
    def value_close(self) -> str:
        return self.value_ends[0]

    def trimmed(self, value: str) -> str:
        return _one_newline_off(value) if self.trim else value


_XML_CALLS = {
    "qwen3_coder": _XmlDialect(_qwen_name, "<parameter=", ">", "", ("</parameter>", "<parameter=", "</function>"),
                               "</function>", True),
    "glm45": _XmlDialect(_glm_name, "<arg_key>", "</arg_key>", "<arg_value>", ("</arg_value>",), None, False),
}
# Qwen3-Coder's bare calls: a block from `<function=` to `</function>` (or the next `<function=`).
_QWEN_BARE = replace(_XML_CALLS["qwen3_coder"], name=_qwen_bare_name, args_end=None)
# Parsers whose final calls are the whole output's, parsed at the finish, with the ids and the
# argument texts the stream sent (their whole-output rules: any part that does not parse leaves
# the whole output as content; a stream's calls, once begun, stand instead: _as_streamed).
_RECONCILED = frozenset({"mistral", "llama3_json", "pythonic"})


@dataclass
class _XmlCall:
    """A Qwen3-Coder call being streamed: its arguments are written as JSON as its parameters come
    (a text value piece by piece, a typed one whole at its end)."""
    start: int  # where its <tool_call> starts, from the first call
    body: int  # where its body starts, in the text
    close_from: int = 0
    open_from: int = 0
    call: int | None = None
    pos: int = 0  # how far its parameters are read
    count: int = 0  # parameters begun
    key: str | None = None  # the parameter being written
    value: int = 0  # where its value starts
    value_scan: int = 0  # where its end is looked for from
    text_value: bool = False  # a text value (streamed as a JSON string)
    value_sent: int = 0  # characters of the value sent
    done: bool = False  # its arguments' closing brace sent

    def __post_init__(self) -> None:
        self.close_from = self.open_from = self.pos = self.body


@dataclass
class _CallBlock:
    """A call's block being streamed: where it starts (from the first call; a sequence's object:
    in the text), where its body starts and its close may be (in the text), and its call once its
    head is out."""
    start: int
    body: int
    close_from: int = 0
    open_from: int = 0
    head_end: int = -1  # where its arguments object starts, once its head is out
    head_from: int = 0  # where a head is read on from (a separator's head: the separator, then where it is)
    args_from: int = 0  # a separator's head: how far the whitespace after the separator is read
    lead_to: int = 0  # a brace head: how far the whitespace before it is read
    call: int | None = None  # its call's index in ToolCallStream.sent
    arguments: _JsonScan = field(default_factory=_JsonScan)

    def __post_init__(self) -> None:
        self.close_from = self.open_from = self.body


class ToolCallStream:
    """Streaming: the text a choice may show as content now, and the calls. Constrained: no
    content. auto under a tagged parser (`hermes`, `mistral`, ...): what comes before the first
    call's tag, holding back a tail that may be the tag's start. auto under `llama3_json` or
    `pythonic`: the output is held until its first characters show whether it opens calls or is
    content (then it streams).

    Calls as OpenAI streams them (`take_deltas`): a Hermes, DeepSeek-V3 / V3.1, Kimi K2, Mistral or
    Llama 3 JSON call as it is written: its id and name once its head is out, then its arguments' text
    piece by piece (the arguments are then the model's JSON text as written); Qwen3-Coder's and
    GLM-4.5's as JSON built as their parameters come; a pythonic call whole once its parenthesis
    closes. Any not sent yet go at the finish. `finish` returns every call, with the ids the
    stream sent (under Mistral, Llama 3 JSON and pythonic, the calls the whole output parses to,
    or the stream's own where that would drop calls it began)."""

    def __init__(self, plan: ToolPlan, stream_calls: bool = True) -> None:
        """`stream_calls`: make the calls' deltas as they come (False: an answer read whole, its
        calls at the end as the whole output parses)."""
        self.plan = plan
        self.text = ""
        self.shown = 0  # characters of text already streamed as content
        self.first_call = -1  # where the first <tool_call> starts, once seen
        self.openers = _OPENERS.get(plan.parser) if not plan.constrained else None
        self.whole: bool | None = None  # llama3_json / pythonic: the output opens calls (None: not known yet)
        self.incremental = stream_calls and not plan.constrained  # (every parser streams its calls)
        self.sent: list[dict] = []  # calls begun on the stream: {"id", "name", "arguments" sent, "closed"}
        self._blocks: dict[int, int] = {}  # block parsers: a block's offset (from the first call) -> its call
        self._open: _CallBlock | None = None  # block parsers: the block being written
        self._scan = 0  # block parsers: where in the text the next block is looked for
        self._sequence: _ObjectSequence | None = None  # Llama 3's JSON, Mistral's array: the objects
        self._python: _PythonScan | None = None  # pythonic: the list's elements
        self._mistral_array: bool | None = None  # Mistral: its calls an array (None: not known yet)
        self._mistral_scan = 0  # Mistral: where the text after the tag is read from to tell
        self._halted = False  # a call the stream cannot follow: it and those after it go at the finish
        self._halted_at = -1  # (Mistral v11) where the part it could not read begins, past its tag
        self._calls_at = 0  # llama3_json / pythonic: where the calls begin (past whitespace and the tag)
        self._bare = False  # qwen3_coder: its calls bare `<function=` blocks (the first marker one)
        self._tag_scan = 0  # before the first call: where its tag is looked for from
        self._deltas: list[dict] = []

    def take_deltas(self) -> list[dict]:
        """The tool-call deltas (OpenAI's shape, with `index`) made since the last take."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def _decide(self) -> str:
        """llama3_json / pythonic: the content to show now, once the output's start tells."""
        if self.whole is None:
            tag, opener = self.openers
            s = self.text.lstrip()
            if s.startswith(tag):
                s = s[len(tag):].lstrip()
                if not s:
                    return ""  # the tag, and nothing after it yet
            elif tag.startswith(s):
                return ""  # whitespace, or maybe the tag's start
            self.whole = s.startswith(opener)
            self._calls_at = len(self.text) - len(s)  # where its "{" or "[" is, when it opens calls
        if self.whole:
            return ""
        out, self.shown = self.text[self.shown:], len(self.text)
        return out

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.openers is not None:
            out = self._decide()
            if self.whole:
                self._advance()
            return out
        if self.plan.constrained:
            return ""
        if self.first_call >= 0:
            self._advance()
            return ""
        limit = self._find_first_call()
        out = self.text[self.shown:limit] if limit > self.shown else ""
        self.shown = max(self.shown, limit)
        if self.first_call >= 0:
            self._advance()
        return out

    def _find_first_call(self) -> int:
        """Looks for the first call's tag in what is new (setting `first_call`); returns how much
        of the text may show as content: up to the tag, or short of a tail that may be its start
        (Qwen3-Coder: or of a bare `<function=` whose name is not out yet)."""
        text = self.text
        tags = (TOOL_CALL_OPEN, QWEN_FUNCTION_OPEN) if self.plan.parser == "qwen3_coder" \
            else (_TAGGED[self.plan.parser],)
        while True:
            found = [(at, tag) for tag in tags if (at := text.find(tag, self._tag_scan)) >= 0]
            if not found:
                self._tag_scan = max(self._tag_scan, len(text) - max(len(tag) for tag in tags) + 1)
                return len(text) - max(_tag_start_at_end(text, tag) for tag in tags)
            at, tag = min(found)
            if tag == QWEN_FUNCTION_OPEN:
                bare = _qwen_bare_call(text, at, self.plan.names)
                if bare is None:  # its name not out yet
                    self._tag_scan = at
                    return at
                if not bare:  # prose
                    self._tag_scan = at + 1
                    continue
            # (blocks are looked for from here: a marker written in prose before it is no call)
            self.first_call, self._bare, self._scan = at, tag == QWEN_FUNCTION_OPEN, at
            return at

    # -- calls as they come ------------------------------------------------------------------

    def _begin(self, name: str, call_id: str | None = None, arguments: str = "", closed: bool = False) -> int:
        k = len(self.sent)
        call_id = call_id or (mistral_call_id() if self.plan.parser == "mistral" else make_call(name, "")["id"])
        self.sent.append({"id": call_id, "name": name, "arguments": arguments, "closed": closed})
        self._deltas.append({"index": k, "id": call_id, "type": "function",
                             "function": {"name": name, "arguments": arguments}})
        return k

    def _extend(self, k: int, arguments: str) -> None:
        """Sends the rest of call k's arguments, when `arguments` goes on from what was sent."""
        sent = self.sent[k]
        if len(arguments) > len(sent["arguments"]) and arguments.startswith(sent["arguments"]):
            self._deltas.append({"index": k, "function": {"arguments": arguments[len(sent["arguments"]):]}})
            sent["arguments"] = arguments

    def _advance(self, final: bool = False) -> None:
        """Sends what the text so far makes of the calls. Each feed reads only what is new (a long
        call's arguments stream without the text before them being read again)."""
        if not self.incremental or self._halted:
            return
        if self.plan.parser in _OPENERS:
            if self._sequence is None and self._python is None:
                at = self._calls_at
                if self.plan.parser == "llama3_json":
                    self._sequence = _ObjectSequence(at, ";")
                else:
                    self._python = _PythonScan(at + 1)  # past the list's "["
            if self._sequence is not None:
                self._advance_sequence(final)
            else:
                self._advance_python()
            return
        if self.plan.parser == "mistral":
            if self._mistral_array is None and not self._mistral_form():
                return  # not known yet
            if self._mistral_array:
                self._advance_sequence(final)
                return
        if self.plan.parser in _JSON_CALLS:
            self._advance_json_calls(final)
            return
        self._advance_xml_calls(final)

    def _next_block(self, opener: str, closer: str, make) -> tuple[object, int, int] | None:
        """The block being written (`make(start from the first call, body)` when one opens), where
        its body ends (-1: not yet) and where the next block may start; None: no block has opened
        since the last one. Except Hermes' (read by a regular expression to its closer), a block
        also ends where the next one opens, its closer left out, as the whole output parses."""
        text, block = self.text, self._open
        if block is None:
            at = text.find(opener, self._scan)
            if at < 0:
                return None
            block = self._open = make(at - self.first_call, at + len(opener))
        close = text.find(closer, block.close_from) if closer is not None else -1
        block.close_from = max(block.body, len(text) - len(closer or "") + 1)
        if self.plan.parser != "hermes":
            following = text.find(opener, block.open_from)
            block.open_from = max(block.body, len(text) - len(opener) + 1)
            if following >= 0 and (close < 0 or following < close):
                return block, following, following
        return block, close, close + len(closer or "")

    def _advance_json_calls(self, final: bool) -> None:
        text, base = self.text, self.first_call
        opener, closer, read_head = _JSON_CALLS[self.plan.parser]
        while True:
            found = self._next_block(opener, closer, _CallBlock)
            if found is None:
                return
            block, close, after = found
            closed = close >= 0 or final
            body_end = close if close >= 0 else len(text)
            if block.call is None and block.head_end < 0:
                head = read_head(text, block.body, body_end, block, closed)
                if head is not None:  # its name is known: the call begins, its arguments go as written
                    name, call_id, block.head_end = head
                    block.call = self._blocks[block.start] = self._begin(name, call_id)
            if block.call is not None:
                block.arguments.feed(text, block.head_end + block.arguments.length, body_end)
                self._extend(block.call, text[block.head_end:block.head_end + block.arguments.length])
                self.sent[block.call]["closed"] = closed
                if closed and self.plan.parser == "mistral":  # (v11) text after the object, before the next
                    # call: content when the whole output does not parse (_as_streamed); else it does not
                    self.sent[block.call]["trailer"] = text[block.head_end + block.arguments.length:body_end].rstrip()
            elif closed and self.plan.parser in _RECONCILED and text[block.body:body_end].strip() and (
                    close >= 0 or not _MISTRAL_HEAD_SO_FAR.fullmatch(text[block.body:body_end].strip())):
                # (Mistral) a part the stream cannot read: it and the rest at the finish (one the
                # output ends in before its arguments begin is a call cut off: no call, not content)
                self._halted = True
                self._halted_at = base + block.start  # (its tag too: content as written)
                return
            elif closed and self.plan.parser == "hermes":  # another shape ("arguments" first): whole, if a call
                _, calls = parse_hermes(text[base + block.start:body_end + len(TOOL_CALL_CLOSE)])
                if calls:
                    self._blocks[block.start] = self._begin(calls[0]["function"]["name"],
                                                            arguments=calls[0]["function"]["arguments"], closed=True)
            if not closed or close < 0:
                return
            self._scan, self._open = after, None

    def _mistral_form(self) -> bool:
        """Mistral: whether the text after the first [TOOL_CALLS] shows the array form (`[` then
        `{` or `]`) or tokenizer v11's (anything else) yet; each feed reads only what is new."""
        text, at = self.text, max(self._mistral_scan, self.first_call + len(MISTRAL_TAG))
        while at < len(text) and text[at].isspace():
            at += 1
        self._mistral_scan = at
        if at == len(text):
            return False
        if text[at] != "[":
            self._mistral_array = False
            return True
        inner = at + 1
        while inner < len(text) and text[inner].isspace():
            inner += 1
        if inner == len(text):
            return False  # (the whitespace after "[" read again next time: an array's is short)
        self._mistral_array = text[inner] in "{]"
        if self._mistral_array:
            self._sequence = _ObjectSequence(at + 1, ",", bracket=True)
        return True

    def _advance_sequence(self, final: bool = False) -> None:
        """Llama 3's `;`-joined call objects, Mistral's array of them: each call begins once its
        `{"name": ..., "arguments": ` is out, its arguments going as written (a head past
        _LONGEST_HEAD characters: read once, when its object closes or the output ends). An object
        that does not begin so (its keys in another order, its arguments a string) or anything else
        between them stops the stream's reading: the finish parses the output whole."""
        seq, text = self._sequence, self.text
        while not seq.stopped:
            if seq.block is None:
                at = seq.pos
                while at < len(text) and text[at].isspace():
                    at += 1
                seq.pos = at
                if at == len(text):
                    return
                if seq.need_separator:
                    if text[at] != seq.separator:
                        seq.stopped = True  # the array's end, or what the whole parse will judge
                        return
                    seq.pos, seq.need_separator = at + 1, False
                    continue
                if text[at] != "{":
                    seq.stopped = True
                    return
                seq.block, seq.outer = _CallBlock(at, at), _JsonScan()
            block = seq.block
            seq.outer.feed(text, block.start + seq.outer.length, len(text))
            end = block.start + seq.outer.length
            if block.call is None and block.head_end < 0:
                head = _hermes_head(text, block.start, end, block, seq.outer.closed or final)
                if head is not None:
                    name, _, block.head_end = head
                    block.call = self._begin(name)
            if block.call is not None:
                block.arguments.feed(text, block.head_end + block.arguments.length, end)
                self._extend(block.call, text[block.head_end:block.head_end + block.arguments.length])
            if not seq.outer.closed:
                return
            if block.call is None:
                seq.stopped = True
                return
            self.sent[block.call]["closed"] = True
            seq.block, seq.pos, seq.need_separator, seq.calls_end = None, end, True, end

    def _advance_python(self) -> None:
        """Pythonic: each element of the list, once its last parenthesis closes, parsed as the whole
        output's calls are (literals only); one that is no call stops the stream's reading."""
        py, text = self._python, self.text
        at = py.pos
        while at < len(text) and not py.stopped:
            ch = text[at]
            if py.quote is not None:
                if py.escaped:
                    py.escaped = False
                elif ch == "\\":
                    py.escaped = True
                elif ch == py.quote:
                    py.quote = None
            elif py.element < 0 and (ch.isspace() or ch == ","):
                pass  # between the calls (the whole parse judges the commas)
            elif py.depth == 0 and ch in ",]":
                py.stopped = True  # the list's end, or an element with no parentheses: no call
            else:
                if py.element < 0:
                    py.element = at
                if ch in "'\"":
                    py.quote = ch
                elif ch in "([{":
                    py.depth += 1
                elif ch in ")]}":
                    py.depth -= 1
                    if py.depth == 0:
                        _, calls = parse_pythonic("[" + text[py.element:at + 1] + "]")
                        if len(calls) != 1:
                            py.stopped = True
                            break
                        fn = calls[0]["function"]
                        self._begin(fn["name"], calls[0]["id"], fn["arguments"], closed=True)
                        py.element, py.calls_end = -1, at + 1
            at += 1
        py.pos = at

    def _advance_xml_calls(self, final: bool) -> None:
        text, dialect = self.text, _QWEN_BARE if self._bare else _XML_CALLS[self.plan.parser]
        opener, closer = (QWEN_FUNCTION_OPEN, QWEN_FUNCTION_CLOSE) if self._bare else (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
        while True:
            found = self._next_block(opener, closer, _XmlCall)
            if found is None:
                return
            block, close, after = found
            end = close if close >= 0 else len(text)
            if block.call is None:
                head = dialect.name(text, block.body, end, close >= 0)
                if head is not None:
                    name, block.pos = head
                    block.call = self._blocks[block.start] = self._begin(name)
            if block.call is not None and not block.done:
                self._xml_parameters(block, dialect, text, end, closed=close >= 0)
            if close < 0:
                return  # (at the finish, a call still open has arguments cut short: no call)
            self._scan, self._open = after, None

    def _xml_parameters(self, block: _XmlCall, d: "_XmlDialect", text: str, end: int, closed: bool) -> None:
        k = block.call
        props = _properties(self.plan.tools, self.sent[k]["name"])
        while True:
            if block.key is None:  # between parameters: the next one, or the arguments' end
                at = text.find(d.key_open, block.pos, end)
                stop = text.find(d.args_end, block.pos, end) if d.args_end else -1
                if stop >= 0 and (at < 0 or stop < at) or at < 0 and closed:
                    self._add(k, "}" if block.count else "{}")
                    block.done = True
                    return
                key_end = text.find(d.key_close, at + len(d.key_open), end) if at >= 0 else -1
                if key_end < 0:
                    return
                value = key_end + len(d.key_close)
                if d.value_open:  # GLM: <arg_value> after the key (and whitespace)
                    while value < end and text[value].isspace():
                        value += 1
                    if not text.startswith(d.value_open, value):
                        if end - value < len(d.value_open) and d.value_open.startswith(text[value:end]) and not closed:
                            return  # not out yet
                        block.pos = key_end + len(d.key_close)  # a key without a value: no parameter
                        continue
                    value += len(d.value_open)
                key = text[at + len(d.key_open):key_end].strip()
                block.text_value = not set(_schema_types(props.get(key))) & _NOT_TEXT
                self._add(k, ("{" if not block.count else ", ") + json.dumps(key, ensure_ascii=False) + ": "
                          + ('"' if block.text_value else ""))
                block.count += 1
                block.key, block.value, block.value_scan, block.value_sent = key, value, value, 0
            ends = [at for at in (text.find(marker, block.value_scan, end) for marker in d.value_ends) if at >= 0]
            value_end = min(ends) if ends else (end if closed else -1)
            if value_end >= 0:  # the value is complete
                value = d.trimmed(text[block.value:value_end])
                if block.text_value:
                    self._add(k, json.dumps(value[block.value_sent:], ensure_ascii=False)[1:-1] + '"')
                else:
                    self._add(k, json.dumps(typed_value(value, props.get(block.key)), ensure_ascii=False))
                block.pos = value_end + (len(d.value_close) if text.startswith(d.value_close, value_end) else 0)
                block.key = None
                continue
            longest = max(len(m) for m in d.value_ends)
            block.value_scan = max(block.value, end - longest + 1)
            held = (*d.value_ends, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, QWEN_FUNCTION_OPEN)  # a tag that may end
            # the value, or the block (a bare Qwen call's block ends where the next <function= opens)
            if block.text_value:  # what surely belongs to the value: not a newline or a tag's start at its end
                value = text[block.value:end]
                if d.trim and value.startswith("\n"):
                    value = value[1:]
                safe = len(value)
                lt = value.rfind("<", max(0, safe - max(len(m) for m in held)))
                if lt >= 0 and any(m.startswith(value[lt:]) for m in held):
                    safe = lt
                if d.trim and value[:safe].endswith("\n"):
                    safe -= 1
                if safe > block.value_sent:
                    self._add(k, json.dumps(value[block.value_sent:safe], ensure_ascii=False)[1:-1])
                    block.value_sent = safe
            return

    def _add(self, k: int, piece: str) -> None:
        self._extend(k, self.sent[k]["arguments"] + piece)

    def _json_calls(self) -> list[dict]:
        """The calls sent whose arguments are a JSON object: a call begun on the stream stands, as
        sent, where the whole output would drop it for text after its arguments (one cut off by
        the output's end, or not JSON, is not a call; NaN and Infinity are Hermes' JSON, as Python
        reads it, not the others')."""
        strict = self.plan.parser != "hermes"
        return [make_call(c["name"], c["arguments"], c["id"]) for c in self.sent
                if _is_json_object(c["arguments"], strict)]

    def finish(self) -> tuple[str, list[dict]]:
        """(content not streamed yet, tool calls); the calls not sent yet become deltas too."""
        if self.plan.constrained or self.openers is not None and self.whole is not False:
            if self._sequence is not None:
                self._advance(final=True)  # (a head too long to read on the way: read now)
            content, calls = self.plan.tool_calls(self.text)
            if not self._answers_stream(calls):
                return self._as_streamed()
            rest = (content or "")[self.shown:] if not calls else ""
            self._reconcile(calls)
            self._send_rest(calls)
            return rest, calls
        if self.openers is not None:  # content all along
            rest, self.shown = self.text[self.shown:], len(self.text)
            return rest, []
        if self.first_call < 0:
            rest, self.shown = self.text[self.shown:], len(self.text)
            return rest, []
        region = self.text[self.first_call:]
        if self.incremental and self.plan.parser not in _RECONCILED and (
                self.plan.parser in _JSON_CALLS or self.plan.parser in _XML_CALLS):
            self._advance(final=True)
            calls = self._json_calls()
            if self.plan.parser != "hermes":  # the others: the text before the calls is the content
                return self.text[self.shown:self.first_call] + ("" if self.sent else region), calls
            kept, at = [], 0  # Hermes': what is outside the calls' blocks
            for m in _BLOCK.finditer(region):
                if m.start() in self._blocks:  # a call begun on the stream: never content too
                    kept.append(region[at:m.start()])
                    at = m.end()
            content = "".join(kept + [region[at:]]).strip() if self.sent else region
            return self.text[self.shown:self.first_call] + content, calls
        if self.incremental and self.plan.parser == "mistral":
            self._advance(final=True)  # (v11) its last call ends with the output
        content, calls = parse_auto(self.plan.parser, region, self.plan.tools)
        if not self._answers_stream(calls):
            return self._as_streamed()
        self._reconcile(calls)
        self._send_rest(calls)
        return self.text[self.shown:self.first_call] + (content or ""), calls

    def _answers_stream(self, calls: list[dict]) -> bool:
        """Whether the whole output's calls begin with the calls the stream began (the same names,
        in order, with the same arguments where the stream's are complete JSON)."""
        if len(calls) < len(self.sent):
            return False
        for call, sent in zip(calls, self.sent):
            fn = call["function"]
            if fn["name"] != sent["name"] or not sent["closed"] or not _same_json(fn["arguments"], sent["arguments"]):
                return False
        return True

    def _as_streamed(self) -> tuple[str, list[dict]]:
        """Under `llama3_json`, `mistral` and `pythonic`, the whole output does not parse to the
        calls the stream began (text after them, a call cut off, a part the whole parse rejects):
        the stream's calls stand, as they were sent (it cannot take them back; vLLM's streams keep
        theirs too), each a call where its arguments are a complete JSON object, and the text after
        them is content; a call begun on the stream is never content as well."""
        calls = [make_call(c["name"], c["arguments"], c["id"]) for c in self.sent
                 if _is_json_object(c["arguments"], strict=False)]  # (NaN: Python's JSON, as parsed whole)
        # (Mistral v11) text after a call's arguments object, before the next call: content
        rest = "".join(c.get("trailer", "") for c in self.sent)
        if self._sequence is not None:
            seq = self._sequence
            if seq.block is None or seq.outer.closed or seq.stopped:  # (else an object cut off by the end)
                rest = _after_calls(self.text[seq.calls_end:], seq.separator, seq.bracket)
        elif self._python is not None:
            py = self._python
            if py.element < 0 or py.stopped or not _PYTHON_CALL_SO_FAR.match(self.text, py.element):
                # (else an element the end cut off that is a call's start: no call, not content)
                rest = _after_calls(self.text[py.calls_end:], ",", True, "<|python_end|>")
        elif self._halted_at >= 0:  # (Mistral v11) from the part the stream could not read
            rest += self.text[self._halted_at:].rstrip()
        before = self.text[self.shown:self.first_call] if self.first_call >= 0 else ""
        self.shown = len(self.text)
        return before + rest, calls

    def _reconcile(self, calls: list[dict]) -> None:
        """The whole output's calls take the ids the stream sent, and the arguments' text it sent
        where that is the same JSON (the model's text as written; the whole parse writes it anew)."""
        for call, sent in zip(calls, self.sent):
            call["id"] = sent["id"]
            fn = call["function"]
            if fn["name"] == sent["name"] and fn["arguments"] != sent["arguments"] and \
                    _same_json(fn["arguments"], sent["arguments"]):
                fn["arguments"] = sent["arguments"]

    def _send_rest(self, calls: list[dict]) -> None:
        for call in calls[len(self.sent):]:
            self._begin(call["function"]["name"], call["id"], call["function"]["arguments"], closed=True)

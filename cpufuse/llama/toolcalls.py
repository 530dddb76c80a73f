"""Tool calls in a model's reply: the formats of llama.cpp's common/chat, parsed from the text
(special tokens rendered). No llguidance here: cpufuse.llama.tools builds the grammars.

    fmt = detect_format(template)                     # from the chat template's text
    content, calls, cut = parse_calls(fmt, text)      # calls: [(name, arguments object)]

Formats (what the reply holds; detection as llama.cpp's, in this order):
  gpt-oss   `<|channel|>` in the template (harmony): `<|channel|>commentary to=functions.NAME
            <|constrain|>json<|message|>{...}<|call|>`; the content is the `final` channel, the
            `analysis` channel is dropped
  granite   `<|start_of_role|>` and `<|tool_call|>`: `<|tool_call|>[{"name", "arguments"}, ...]`
  phi4      `<|tool_call|>` and `<|/tool_call|>` (Phi-4-mini): `<|tool_call|>{"name",
            "arguments"}<|/tool_call|>` (an object or an array), one or more
  hermes    `<tool_call>` (Hermes 2/3 Pro, Qwen 2.5/3, SmolLM3): as llama.cpp's Hermes parser, a
            call is `{"name": ..., "arguments": {...}}` bare or wrapped in one of <tool_call>,
            <function_call>, <tool>, <tools>, <response>, <json>, <xml>, <JSON> (closed by the
            matching end tag), optionally inside a ```json / ```xml fence, also in doubled braces
            `{{"name": ..., "arguments": {...}}}` (Qwen2.5-Coder-1.5B writes it, at times with a
            stray `}` more, also taken: its template shows the call as `{"name": <function-name>,
            ...}`; cpufuse only), or
            `<function=NAME>{...}</function>` / `<function name="NAME">{...}</function>`
  llama3    `<|start_header_id|>ipython<|end_header_id|>` (Llama 3.1-3.3):
            `{"type": "function", "name": ..., "parameters": {...}}` ("type" optional; "arguments"
            also read; llama.cpp reads it only at the start of the reply, cpufuse anywhere), or `<|python_tag|>` then such JSON or a built-in tool's
            `name.call(key=value, ...)`
  mistral   `[TOOL_CALLS]`: `[TOOL_CALLS][{"name", "arguments", "id"}, ...]` (Nemo) or
            `[TOOL_CALLS]NAME[ARGS]{...}` / `NAME[CALL_ID]id[ARGS]{...}` (Small 3.2, Magistral)
  generic   any other template (Gemma 2/3, ChatML...): the whole reply is JSON
            {"tool_call": {...}} / {"tool_calls": [...]} / {"response": "..."}

A call cut short (max_tokens) is dropped with the text after it; the complete calls before it
are kept (`cut` is then True). Arguments given as a JSON string are parsed.
"""
from __future__ import annotations

import json
import re
from typing import Any, List, Optional, Tuple

__all__ = ["FORMATS", "detect_format", "parse_calls"]

FORMATS = ("hermes", "llama3", "mistral", "granite", "phi4", "gpt-oss", "generic")
_DEC = json.JSONDecoder()


def detect_format(template: Optional[str]) -> str:
    """the tool-call format of a chat template (see the module docstring)"""
    t = template or ""
    if "<|channel|>" in t:
        return "gpt-oss"
    if "<|tool_call|>" in t:
        return "phi4" if "<|/tool_call|>" in t else "granite"
    if "<tool_call>" in t:
        return "hermes"
    if "<|start_header_id|>ipython<|end_header_id|>" in t or "<|python_tag|>" in t:
        return "llama3"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    return "generic"


def _args(obj: dict, *keys) -> Any:
    for k in keys:
        if k in obj:
            a = obj[k]
            if isinstance(a, str):
                try:
                    a = json.loads(a)
                except json.JSONDecodeError:
                    pass
            return a
    return {}


def _call(obj) -> Optional[Tuple[str, Any]]:
    """(name, arguments) of one call object: {"name", "arguments" | "parameters"}, also wrapped
    as OpenAI writes it ({"type": "function", "function": {...}})"""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    return name, _args(obj, "arguments", "parameters")


def _json_at(text: str, i: int):
    """(value, end) of the JSON value at text[i:] (leading whitespace skipped), or None if it is
    not complete JSON"""
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    try:
        return _DEC.raw_decode(text, i)
    except json.JSONDecodeError:
        return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


_HERMES_OPEN = re.compile(
    r'(```(?:xml|json)?\n\s*)?'
    r'(<tool_call>|<function_call>|<tool>|<tools>|<response>|<json>|<xml>|<JSON>)?'
    r'(\s*\{(?=\s*\{\s*"name"))?'              # {{"name": ...}}: the call in doubled braces
    r'(\s*\{\s*"name")'
    r'|<function=([^>]+)>'
    r'|<function name="([^"]+)">')
_CLOSE_BRACE = re.compile(r'(?:\s*\})+')        # the doubled brace, and any stray one after it


def _parse_hermes(text: str):
    content, calls, pos = [], [], 0
    while True:
        m = _HERMES_OPEN.search(text, pos)
        if m is None:
            break
        start = m.start()
        if m.group(4) is not None:
            got = _json_at(text, m.start(4))
            if got is None:                         # not JSON, or cut short
                if _could_be_cut(text, m.start(4)):
                    content.append(text[pos:start])
                    return "".join(content), calls, True
                content.append(text[pos:m.end()])
                pos = m.end()
                continue
            obj, end = got
            call = _call(obj) if isinstance(obj, dict) and ("arguments" in obj or "parameters" in obj) else None
            if call is None:
                content.append(text[pos:m.end()])
                pos = m.end()
                continue
            close = "</" + m.group(2)[1:] if m.group(2) else ""
            if m.group(3):                          # the doubled brace closes after the call
                b = _CLOSE_BRACE.match(text, end)
                if b is None:                       # not doubled after all: what precedes is text
                    start, close = m.start(4), ""
                else:
                    end = b.end()
        else:
            name = m.group(5) or m.group(6)
            got = _json_at(text, m.end())
            if got is None or not isinstance(got[0], dict):
                if got is None and _could_be_cut(text, m.end()):
                    content.append(text[pos:start])
                    return "".join(content), calls, True
                content.append(text[pos:m.end()])
                pos = m.end()
                continue
            call, end = (name.strip(), got[0]), got[1]
            close = "</function>"
        j = _skip_ws(text, end)
        if close and text.startswith(close, j):
            j = _skip_ws(text, j + len(close))
        if m.group(1) and start == m.start() and text.startswith("```", j):
            j = _skip_ws(text, j + 3)
        content.append(text[pos:start])
        calls.append(call)
        pos = j
    content.append(text[pos:])
    return "".join(content), calls, False


def _could_be_cut(text: str, i: int) -> bool:
    """text[i:] is the start of a JSON value cut off by the end of the text"""
    try:
        _DEC.raw_decode(text, _skip_ws(text, i))
    except json.JSONDecodeError as e:
        return e.pos >= len(text) or "Unterminated" in e.msg
    return False


def _json_list(text: str, i: int, sep: str = ""):
    """calls from JSON values at text[i:] (objects, or arrays of them), separated by
    whitespace and `sep`: (calls, end, cut)"""
    calls = []
    while True:
        j = _skip_ws(text, i)
        if j >= len(text) or text[j] not in "[{":
            return calls, i, False
        got = _json_at(text, j)
        if got is None:
            return calls, j, _could_be_cut(text, j)
        v, end = got
        items = v if isinstance(v, list) else [v]
        cs = [_call(o) for o in items]
        if not cs or any(c is None for c in cs):
            return calls, i, False
        calls.extend(cs)
        i = end
        k = _skip_ws(text, i)
        if sep and text.startswith(sep, k):
            i = k + len(sep)


_LLAMA3_START = re.compile(r'\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"')
_BUILTIN = re.compile(r'\s*(\w+)\s*\.\s*call\(')
_KWARG = re.compile(r'\s*(\w+)\s*=\s*')


def _parse_llama3(text: str):
    k = text.find("<|python_tag|>")
    if k >= 0:
        head, i = text[:k], k + len("<|python_tag|>")
        m = _BUILTIN.match(text, i)
        if m:                                       # name.call(query="...", ...)
            args, j = {}, m.end()
            while True:
                a = _KWARG.match(text, j)
                if not a:
                    break
                got = _json_at(text, a.end())
                if got is None:
                    return head, [], True
                args[a.group(1)] = got[0]
                j = _skip_ws(text, got[1])
                if text.startswith(",", j):
                    j += 1
            j = _skip_ws(text, j)
            if not text.startswith(")", j):
                return head, [], True
            return head + text[j + 1:].strip(), [(m.group(1), args)], False
        calls, end, cut = _json_list(text, i, ";")
        return (head + ("" if cut else text[end:])), calls, cut
    m = _LLAMA3_START.search(text)
    if m is None:
        return text, [], False
    head = text[:m.start()]
    calls, end, cut = _json_list(text, m.start(), ";")
    if not calls and not cut:
        return text, [], False
    return head + ("" if cut else text[end:]), calls, cut


_MISTRAL_NAMED = re.compile(r'\s*([\w.-]+)(?:\[CALL_ID\]([\w-]*))?\[ARGS\]')


def _parse_mistral(text: str):
    k = text.find("[TOOL_CALLS]")
    if k < 0:
        return text, [], False
    content, i, calls = text[:k], k + len("[TOOL_CALLS]"), []
    while True:
        m = _MISTRAL_NAMED.match(text, i)
        if m:                                      # NAME[ARGS]{...}
            got = _json_at(text, m.end())
            if got is None:
                return content, calls, True
            calls.append((m.group(1), got[0]))
            i = _skip_ws(text, got[1])
            if text.startswith("[TOOL_CALLS]", i):
                i += len("[TOOL_CALLS]")
            continue
        cs, end, cut = _json_list(text, i)
        calls.extend(cs)
        if cut:
            return content, calls, True
        j = _skip_ws(text, end)
        if cs and text.startswith("[TOOL_CALLS]", j):
            i = j + len("[TOOL_CALLS]")
            continue
        return content + text[end:], calls, False


def _parse_marked(text: str, open_tag: str, close_tag: str):
    """`open_tag` JSON (an object or an array of calls) [`close_tag`], repeated (granite, phi4)"""
    content, calls, pos = [], [], 0
    while True:
        k = text.find(open_tag, pos)
        if k < 0:
            break
        content.append(text[pos:k])
        cs, end, cut = _json_list(text, k + len(open_tag))
        calls.extend(cs)
        if cut:
            return "".join(content), calls, True
        if not cs:
            content.append(open_tag)
            pos = k + len(open_tag)
            continue
        j = _skip_ws(text, end)
        if close_tag and text.startswith(close_tag, j):
            j = _skip_ws(text, j + len(close_tag))
        pos = j
    content.append(text[pos:])
    return "".join(content), calls, False


_HARMONY_CALL = re.compile(r'to=functions\.([\w.-]+)[^<]*(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>[^<]*)?<\|message\|>')
_HARMONY_FINAL = re.compile(r'<\|channel\|>final<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|$)', re.S)


def _parse_harmony(text: str):
    calls, cut = [], False
    for m in _HARMONY_CALL.finditer(text):
        got = _json_at(text, m.end())
        if got is None:
            cut = True
            break
        calls.append((m.group(1), got[0]))
    finals = _HARMONY_FINAL.findall(text)
    if finals:
        content = "".join(finals)
    elif "<|channel|>" in text or calls or cut:
        content = ""
    else:
        content = text
    return content, calls, cut


def _parse_generic(text: str):
    got = _json_at(text, 0)
    if got is None:
        return text, [], _could_be_cut(text, 0)
    obj = got[0]
    if not isinstance(obj, dict):
        return text, [], False
    if "response" in obj:
        r = obj["response"]
        return (r if isinstance(r, str) else json.dumps(r)), [], False
    if isinstance(obj.get("tool_call"), dict):
        c = _call(obj["tool_call"])
        return "", ([c] if c else []), False
    if isinstance(obj.get("tool_calls"), list):
        cs = [_call(c) for c in obj["tool_calls"]]
        return "", [c for c in cs if c], False
    return text, [], False


_PARSERS = {"hermes": _parse_hermes, "llama3": _parse_llama3, "mistral": _parse_mistral,
            "granite": lambda t: _parse_marked(t, "<|tool_call|>", ""),
            "phi4": lambda t: _parse_marked(t, "<|tool_call|>", "<|/tool_call|>"),
            "gpt-oss": _parse_harmony, "generic": _parse_generic}


def parse_calls(fmt: str, text: str) -> Tuple[str, List[Tuple[str, Any]], bool]:
    """(content, [(name, arguments)], cut) of a reply in format `fmt` (module docstring)"""
    if fmt not in _PARSERS:
        raise ValueError(f"tool format must be one of {FORMATS}, got {fmt!r}")
    return _PARSERS[fmt](text)

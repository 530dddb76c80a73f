"""OpenAI-style tool calls: the prompt side (tools into the chat template), the grammar that makes
the model call them (llguidance, see cpufuse.llama.constrain) and the reading of its output
(cpufuse.llama.toolcalls, which lists the formats: hermes, llama3, mistral, granite, phi4, gpt-oss,
generic, chosen from the chat template's text as llama-server chooses them).

    spec = ToolSpec(tools, tool_choice="auto", parallel_tool_calls=False, template=tpl, tokenizer=tok)
    messages, extra = spec.messages(messages)   # history with tool calls rendered for the template
    constraint = spec.constraint()              # None when nothing is constrained (tool_choice none)
    content, calls = spec.parse(text)           # calls: [{"id", "type", "function": {"name", "arguments"}}]

tool_choice: "none" (tools described, nothing constrained or parsed), "auto" (free text; a call
is read in any form its format's parser accepts, and once the format's own opening appears,
e.g. <tool_call>, the call is constrained by a lazy grammar; hermes also triggers on the JSON
forms Qwen2.5-Coder writes, see below; generic: the JSON reply), "required"
(a call, fully constrained) or {"type": "function", "function": {"name": ...}} (exactly one call
of that function). parallel_tool_calls defaults to False, as llama-server: one call at most;
True allows several (not with a named tool_choice).

Arguments: a tool's `parameters` schema is closed as llama.cpp's schema-to-grammar closes it: an
object schema with `properties` and no `additionalProperties` takes only the listed properties
(`additionalProperties: true` or a schema allows more). This holds where the grammar constrains
the call: "required", a named function, and "auto" from the call's opening on. Hermes under
"auto" opens a call with `<tool_call>` anywhere, and (llama.cpp's Hermes handler: bare or fenced,
at the start) with a JSON object that starts `{"name": "<listed function>"`: bare or in doubled braces `{{"name": ...}}` at
the start of the reply, or in a ```json / ``` fence anywhere; from there the function's arguments,
the closing (`}`, fence) and parallel_tool_calls are enforced (several calls: the same form again).
Other forms the parser reads (the other wrapper tags, a bare object after text, "arguments"
before "name") are not constrained: their arguments are taken as written, only the function's
name and that they are an object are checked.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, List, Optional, Tuple

from .constrain import JSON_WHITESPACE, Constraint, _llg, close_schema
from .toolcalls import FORMATS, detect_format, parse_calls

__all__ = ["ToolSpec", "detect_format", "FORMATS", "ToolStream", "close_schema"]  # close_schema: constrain's

_WS = {"whitespace_pattern": JSON_WHITESPACE}
def _check_tools(tools) -> List[dict]:
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"tools must be a non-empty array of tools, got {tools!r:.80}")
    out, names = [], set()
    for i, t in enumerate(tools):
        if hasattr(t, "model_dump"):
            t = t.model_dump()
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}, got {t!r:.80}")
        f = t.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}].function must be an object with a non-empty string 'name'")
        name = f["name"]
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object, got "
                             f"{type(params).__name__}")
        out.append({"type": "function", "function": dict(f, parameters=close_schema(params))})
    return out


def _call_schema(f: dict, args_key: str = "arguments") -> dict:
    return {"type": "object", "properties": {"name": {"const": f["name"]}, args_key: f["parameters"]},
            "required": ["name", args_key], "additionalProperties": False}


def _any(schemas: List[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _inline(schema: dict) -> str:
    """a %json lexeme body for a Lark grammar (one line), with the JSON whitespace of constrain.py"""
    return "%json " + json.dumps(dict(schema, **{"x-guidance": _WS}), ensure_ascii=False)


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


# how each format writes one call (name, arguments object) into an assistant message's text
def _call_text(fmt: str, name: str, args: Any) -> str:
    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
    if fmt == "llama3":
        return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)
    if fmt == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": args}], ensure_ascii=False)
    if fmt == "granite":
        return "<|tool_call|>" + json.dumps([{"name": name, "arguments": args}], ensure_ascii=False)
    if fmt == "phi4":
        return "<|tool_call|>" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "<|/tool_call|>"
    if fmt == "gpt-oss":
        return (f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
                + json.dumps(args, ensure_ascii=False) + "<|call|>")
    return json.dumps({"tool_call": {"name": name, "arguments": args}}, ensure_ascii=False)


_HERMES_TAGS = ("", "<tool_call>", "<function_call>", "<tool>", "<tools>", "<response>", "<json>", "<xml>", "<JSON>")
# hermes under "auto": the JSON forms of a call the lazy grammar also triggers on, besides
# <tool_call>: (fence, doubled braces, anywhere in the reply rather than only at its start)
_JSON_FORMS = [("", False, False), ("", True, False)] + [(f, d, True) for f in ("```json\n", "```\n")
                                                         for d in (False, True)]
_W = None          # in an opening pattern: any whitespace
# the openings of a call in streamed text, per format: sequences of literals and _W; a text that
# is a prefix of one is held back, one that has it all starts the calls
_OPENINGS = {
    "hermes": [(fence, _W if fence else "", tag, _W if (fence or tag) else "", "{", _W, dbl, _W, '"name"')
               for fence in ("", "```\n", "```json\n", "```xml\n") for tag in _HERMES_TAGS
               for dbl in ("", "{")] + [("<function=",), ('<function name="',)],
    "llama3": [("<|python_tag|>",), ("{", _W, '"name"'), ("{", _W, '"type"')],
    "mistral": [("[TOOL_CALLS]",)],
    "granite": [("<|tool_call|>",)],
    "phi4": [("<|tool_call|>",)],
}


def _opening(pattern, s: str) -> str:
    """'yes' if s starts with the opening, 'maybe' if s is a prefix of it, else 'no'"""
    i = 0
    for piece in pattern:
        if piece is _W:
            while i < len(s) and s[i] in " \t\r\n":
                i += 1
            continue
        if not piece:
            continue
        rest = s[i:i + len(piece)]
        if rest != piece[:len(rest)]:
            return "no"
        if len(rest) < len(piece):
            return "maybe"
        i += len(piece)
    return "yes"


class ToolSpec:
    """The tools of one request (see the module docstring). ValueError for malformed tools or a
    tool_choice naming no given function."""

    def __init__(self, tools, tool_choice=None, parallel_tool_calls: Optional[bool] = None,
                 template: Optional[str] = None, tokenizer=None, fmt: Optional[str] = None):
        self.tools = _check_tools(tools)
        self.tokenizer = tokenizer
        self.template = template
        self.format = fmt or detect_format(template)
        if self.format not in FORMATS:
            raise ValueError(f"tool format must be one of {FORMATS}, got {self.format!r}")
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise TypeError(f"parallel_tool_calls must be a bool, got {type(parallel_tool_calls).__name__}")
        self.parallel = bool(parallel_tool_calls)           # llama-server's default: False
        self.named = None
        if tool_choice is None:
            tool_choice = "auto"
        if isinstance(tool_choice, dict):
            f = tool_choice.get("function")
            name = f.get("name") if isinstance(f, dict) else None
            if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
                raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                 f'"function": {{"name": ...}}}}, got {tool_choice!r:.80}')
            if name not in [t["function"]["name"] for t in self.tools]:
                raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
            self.named = name
            self.choice = "named"
            self.parallel = False                          # a named function: exactly one call
        elif tool_choice in ("none", "auto", "required"):
            self.choice = tool_choice
        else:
            raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, '
                             f"got {tool_choice!r:.80}")

    # ------------------------------------------------------------------ prompt
    @property
    def functions(self) -> List[dict]:
        fs = [t["function"] for t in self.tools]
        return [f for f in fs if f["name"] == self.named] if self.named else fs

    def template_uses_tools(self) -> bool:
        return "tools" in (self.template or "")

    def system_prompt(self) -> str:
        """the tool description injected as a system message when the template has no tools"""
        fs = json.dumps([t["function"] for t in self.tools], ensure_ascii=False)
        if self.format == "generic":
            fmt = ('Reply with JSON only: {"tool_call": {"name": <function name>, "arguments": <arguments '
                   'object>}}' + (' (or {"tool_calls": [...]} for several calls)' if self.parallel else "")
                   + (' or {"response": <your answer>}' if self.choice in ("auto", "none") else ""))
        else:
            fmt = "To call a function, reply with " + _call_text(self.format, "<function name>", "<arguments object>")
        return f"You can call these functions:\n{fs}\n{fmt}"

    def call_text(self, name: str, args: Any) -> str:
        """one call in this format's text (for assistant tool_calls in the history)"""
        return _call_text(self.format, name, args)

    def messages(self, messages: List[dict]) -> Tuple[List[dict], dict]:
        """(messages, extra template variables) for rendering with tools: `tools` goes to templates
        that use it; otherwise a system message describes them. Assistant tool_calls are given to
        a template that handles them (arguments parsed into objects), else written into the
        content in this format; tool results stay `tool` messages for the template."""
        handles_calls = "tool_calls" in (self.template or "")
        out = []
        for m in messages:
            m = dict(m)
            calls = m.get("tool_calls")
            if m.get("role") == "assistant" and calls:
                parsed = []
                for c in calls:
                    f = c.get("function", {}) if isinstance(c, dict) else {}
                    args = f.get("arguments")
                    try:
                        args = json.loads(args) if isinstance(args, str) else args
                    except json.JSONDecodeError:
                        pass
                    parsed.append({"id": c.get("id"), "type": "function",
                                   "function": {"name": f.get("name"), "arguments": args}})
                if handles_calls:
                    m["tool_calls"] = parsed
                else:
                    m.pop("tool_calls")
                    text = "\n".join(self.call_text(c["function"]["name"], c["function"]["arguments"])
                                     for c in parsed)
                    m["content"] = ((m.get("content") or "") + ("\n" if m.get("content") else "") + text)
            if m.get("content") is None:
                m["content"] = ""
            out.append(m)
        extra = {}
        if self.template_uses_tools():
            extra["tools"] = self.tools
        else:
            sysmsg = self.system_prompt()
            if out and out[0].get("role") == "system":
                out[0] = dict(out[0], content=(out[0].get("content") or "") + "\n\n" + sysmsg)
            else:
                out.insert(0, {"role": "system", "content": sysmsg})
        return out, extra

    # ------------------------------------------------------------------ grammar
    def _special_id(self, text: str) -> Optional[int]:
        tok = self.tokenizer
        if tok is None:
            return None
        i = tok.token_to_id.get(text)
        return i if i is not None and tok.is_hidden(i) else None

    def _text(self, s: str) -> str:
        """a Lark expression for the literal text s: a special token of the vocabulary (e.g.
        <|tool_call|>) as that token, the rest as text"""
        import re
        parts = []
        for piece in re.split(r"(<\|[^|<>]+\|>|\[[A-Z_]+\])", s):
            if not piece:
                continue
            sid = self._special_id(piece)
            parts.append(f"<[{sid}]>" if sid is not None else _lit(piece))
        return " ".join(parts) if parts else '""'

    def _call_rule(self):
        """(opening text, Lark expression of one call after it, closing text, separator between
        calls or None when several calls share one opening (a JSON array))"""
        fs = self.functions
        calls = _inline(_any([_call_schema(f) for f in fs]))
        arr = {"type": "array", "items": _any([_call_schema(f) for f in fs]), "minItems": 1}
        if not self.parallel:
            arr["maxItems"] = 1
        if self.format == "hermes":
            return "<tool_call>", '"\\n" ' + calls, "\n</tool_call>", "\n"
        if self.format == "phi4":
            return "<|tool_call|>", calls, "<|/tool_call|>", ""
        if self.format in ("mistral", "granite"):
            return ("[TOOL_CALLS]" if self.format == "mistral" else "<|tool_call|>"), _inline(arr), "", None
        if self.format == "gpt-oss":
            alts = [self._text(f["name"] + " <|constrain|>json<|message|>") + " " + _inline(f["parameters"])
                    for f in fs]
            return "<|channel|>commentary to=functions.", "(" + " | ".join(alts) + ")", "<|call|>", ""
        alts = [_lit(f["name"] + '", "parameters": ') + " " + _inline(f["parameters"]) + ' "}"' for f in fs]
        return '{"name": "', "(" + " | ".join(alts) + ")", "", "\n"         # llama3

    def grammar(self) -> Optional[str]:
        """the llguidance grammar, or None (tool_choice "none"; "auto" with gpt-oss, read only)"""
        if self.choice == "none":
            return None
        llg = _llg()
        fs = self.functions
        forced = self.choice in ("required", "named")
        if self.format == "generic":
            call = _any([_call_schema(f) for f in fs])
            if self.parallel:
                calls = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": call,
                                                                          "minItems": 1}},
                         "required": ["tool_calls"], "additionalProperties": False}
            else:
                calls = {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                         "additionalProperties": False}
            if not forced:
                calls = {"anyOf": [calls, {"type": "object", "properties": {"response": {"type": "string"}},
                                           "required": ["response"], "additionalProperties": False}]}
            return llg.LLMatcher.grammar_from_json_schema(calls, defaults=_WS)
        if self.format == "gpt-oss" and not forced:
            return None
        trig, rest, close, sep = self._call_rule()
        if close:
            rest += " " + self._text(close)
        trig_tok = self._text(trig)
        more = f"({_lit(sep) + ' ' if sep else ''}call)*" if (self.parallel and sep is not None) else ""
        lines = ["%llguidance {}"]
        if forced:
            lines += [f"start: call {more}", f"call: {trig_tok} {rest}"]
        else:
            lines += ["start: plain | first " + more, "plain: TEXT", r"TEXT: /(.|\n)*/",
                      f"call: {trig_tok} {rest}"]
            if "<[" in trig_tok.split(" ")[0]:   # a special token cannot occur in text: no lazy lexeme needed
                lines += [f"first: TEXT {trig_tok} {rest}"]
            else:
                lines += [f"trig[lazy]: TEXT {trig_tok}", f"first: trig {rest}"]
        if self.format == "hermes" and not forced:
            lines[1] += "".join(f" | {r}" for r in self._json_forms(lines))
        return llg.LLMatcher.grammar_from_lark("\n".join(lines))

    def _json_forms(self, lines: List[str]) -> List[str]:
        """hermes under "auto": the calls written as a JSON object without <tool_call> (module
        docstring), as rules appended to `lines`; returns the alternatives of `start`. Each form
        and function has a lazy trigger that ends after the function's name, so the arguments
        after it follow that function's schema; the bare and doubled forms trigger only at the
        start of the reply (as llama.cpp's), a fence anywhere."""
        ws, sp = JSON_WHITESPACE, r"[ \t\n]*"
        alts = []
        for k, f in enumerate(self.functions):
            lines.append(f'args{k}: /{ws},{ws}"arguments"{ws}:{ws}/ {_inline(f["parameters"])} /{ws}\\}}/')
        for j, (fence, dbl, anywhere) in enumerate(_JSON_FORMS):
            close = (f" /{ws}\\}}/" if dbl else "") + (f" /{sp}```/" if fence else "")
            head = fence.replace("\n", r"\n") + sp + r"\{" + (sp + r"\{" if dbl else "") + sp + '"name"' + sp + ":" + sp
            for k, f in enumerate(self.functions):
                name = _lit(json.dumps(f["name"], ensure_ascii=False))
                lines += [f"t{j}_{k}[lazy]: {'TEXT ' if anywhere else ''}/{sp}{head}/ {name}",
                          f"n{j}_{k}: /{sp}{head}/ {name}"]
                alts.append(f"t{j}_{k} args{k}{close}" + (f" more{j}*" if self.parallel else ""))
            lines.append(f"more{j}: " + " | ".join(f"n{j}_{k} args{k}{close}" for k in range(len(self.functions))))
        return alts

    def constraint(self) -> Optional[Constraint]:
        g = self.grammar()
        if g is None:
            return None
        if self.tokenizer is None:
            raise ValueError("ToolSpec.constraint() needs the tokenizer")
        return Constraint(self.tokenizer, g, "tools")

    @property
    def openings(self) -> Optional[list]:
        """the opening patterns of a call in streamed text (None: the whole reply is held)"""
        return _OPENINGS.get(self.format)

    # ------------------------------------------------------------------ output
    def parse(self, text: str) -> Tuple[Optional[str], Optional[List[dict]]]:
        """(content, tool_calls) of a reply's text (special tokens rendered). tool_calls None: no
        call (the text is content); content None: nothing but calls. A call cut short
        (max_tokens) is dropped with the text after it; complete calls before it are kept. A call
        of a function not in tools, or with arguments that are not an object, makes the reply
        plain text. Without parallel_tool_calls only the first call is kept (and checked)."""
        if self.choice == "none":
            return text, None
        content, calls, cut = parse_calls(self.format, text)
        if not calls:
            return (content if not cut else (content or None)), None
        allowed = {t["function"]["name"] for t in self.tools}
        if self.named:
            allowed = {self.named}
        if not self.parallel:
            calls = calls[:1]
        out = []
        for name, args in calls:
            if name not in allowed or not isinstance(args, dict):
                return text, None
            out.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        content = content.strip() if content else None
        return (content or None), out


class ToolStream:
    """Streamed text of a tool request: push(text) -> content to send now; finish() ->
    (content left, tool_calls or None). Content is sent as it comes until a call may begin (text
    that could be the start of one of the format's openings is held back); from a call's opening
    on, the text is kept until the end, when the reply is parsed. Fully constrained choices and
    the generic and gpt-oss formats send content only at the end."""

    def __init__(self, spec: ToolSpec):
        self.spec = spec
        self.text = ""
        self.sent = 0
        self.openings = spec.openings if spec.choice != "none" else None
        self.held = spec.choice in ("required", "named") or self.openings is None

    def _hold_from(self) -> Tuple[int, bool]:
        """(index from which the unsent text must be held, whether a call surely began there)"""
        t = self.text
        for p in range(self.sent, len(t)):
            states = {_opening(o, t[p:]) for o in self.openings}
            if "yes" in states:
                return p, True
            if "maybe" in states:
                return p, False
        return len(t), False

    def push(self, piece: str) -> str:
        self.text += piece
        if self.spec.choice == "none":
            self.sent = len(self.text)
            return piece
        if self.held:
            return ""
        k, began = self._hold_from()
        out, self.sent = self.text[self.sent:k], k
        self.held = began
        return out

    def finish(self) -> Tuple[Optional[str], Optional[List[dict]]]:
        content, calls = self.spec.parse(self.text)
        sent = self.text[:self.sent]
        if calls is None:
            return (self.text[self.sent:] if self.sent else content) or None, None
        # the content before the first call was sent already (parse strips it)
        rest = content or ""
        if sent.strip() and rest.startswith(sent.strip()):
            rest = rest[len(sent.strip()):]
        return (rest.strip() or None), calls

"""OpenAI-style tool calls: the prompt side (tools into the chat template), the grammar that makes
the model call them (llguidance, see cpufuse.llama.constrain) and the parser of its output.

    spec = ToolSpec(tools, tool_choice="auto", parallel_tool_calls=True, template=tpl, tokenizer=tok)
    messages = spec.messages(messages)          # history with tool calls rendered for the template
    constraint = spec.constraint()              # None when nothing is constrained (tool_choice none)
    content, calls = spec.parse(text)           # calls: [{"id", "type", "function": {"name", "arguments"}}]

Formats (chosen from the chat template's text, as llama-server does):
  hermes   `<tool_call>` in the template (Hermes 2 Pro, Qwen 2.5/3):
           <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one per call
  llama3   `<|python_tag|>` or the `ipython` role (Llama 3.x): {"name": ..., "parameters": {...}}
  mistral  `[TOOL_CALLS]` (Mistral Nemo...): [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
  generic  any other template: the whole reply is JSON, {"tool_call": {"name", "arguments"}}
           ({"tool_calls": [...]} with parallel calls; {"response": "..."} for a plain answer
           under "auto"), and a system message describes the tools and this format.

tool_choice: "none" (tools described, nothing constrained or parsed), "auto" (hermes, llama3,
mistral: free text, and a call once its opening text appears is constrained by a lazy grammar;
generic: the JSON reply), "required" (at least one call, fully constrained), or
{"type": "function", "function": {"name": ...}} (that function, fully constrained).
parallel_tool_calls false: exactly one call at most.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, List, Optional, Tuple

from .constrain import JSON_WHITESPACE, Constraint, _llg

__all__ = ["ToolSpec", "detect_format", "FORMATS", "ToolStream"]

FORMATS = ("hermes", "llama3", "mistral", "generic")
_WS = {"whitespace_pattern": JSON_WHITESPACE}


def detect_format(template: Optional[str]) -> str:
    t = template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return "generic"


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
        out.append({"type": "function", "function": dict(f, parameters=params)})
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
        self.parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
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
        fmt = {
            "hermes": 'To call a function, reply with <tool_call>\n{"name": <function name>, "arguments": '
                      "<arguments object>}\n</tool_call>",
            "llama3": 'To call a function, reply with {"name": <function name>, "parameters": <arguments '
                      "object>}",
            "mistral": 'To call functions, reply with [TOOL_CALLS][{"name": <function name>, "arguments": '
                       "<arguments object>}]",
            "generic": 'Reply with JSON only: {"tool_call": {"name": <function name>, "arguments": '
                       '<arguments object>}}' + (' (or {"tool_calls": [...]} for several calls)'
                                                 if self.parallel else "")
                       + (' or {"response": <your answer>}' if self.choice in ("auto", "none") else ""),
        }[self.format]
        return f"You can call these functions:\n{fs}\n{fmt}"

    def call_text(self, name: str, args: Any) -> str:
        """one call in this format's text (for assistant tool_calls in the history)"""
        if self.format == "hermes":
            return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
        if self.format == "llama3":
            return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)
        if self.format == "mistral":
            return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": args}], ensure_ascii=False)
        return json.dumps({"tool_call": {"name": name, "arguments": args}}, ensure_ascii=False)

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

    def grammar(self) -> Optional[str]:
        """the llguidance grammar, or None (tool_choice "none")"""
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
        sep = '"\\n"'
        if self.format == "hermes":
            trig = "<tool_call>"
            rest = f'"\\n" {_inline(_any([_call_schema(f) for f in fs]))} "\\n</tool_call>"'
        elif self.format == "mistral":
            trig = "[TOOL_CALLS]"
            arr = {"type": "array", "items": _any([_call_schema(f) for f in fs]), "minItems": 1}
            if not self.parallel:
                arr["maxItems"] = 1
            rest = _inline(arr)
            sep = None                      # several calls go into the one array
        else:                               # llama3
            trig = '{"name": "'
            alts = [_lit(f["name"] + '", "parameters": ') + " " + _inline(f["parameters"]) + ' "}"'
                    for f in fs]
            rest = "(" + " | ".join(alts) + ")"
        sid = self._special_id(trig)
        trig_tok = f"<[{sid}]>" if sid is not None else _lit(trig)
        more = f"({sep} call)*" if (self.parallel and sep) else ""
        lines = ["%llguidance {}"]
        if forced:
            lines += [f"start: call {more}", f"call: {trig_tok} {rest}"]
        else:
            lines += ["start: plain | first " + more, "plain: TEXT", r"TEXT: /(.|\n)*/",
                      f"call: {trig_tok} {rest}"]
            if sid is not None:           # a special token cannot occur in text: no lazy lexeme needed
                lines += [f"first: TEXT {trig_tok} {rest}"]
            else:
                lines += [f"trig[lazy]: TEXT {trig_tok}", f"first: trig {rest}"]
        return llg.LLMatcher.grammar_from_lark("\n".join(lines))

    def constraint(self) -> Optional[Constraint]:
        g = self.grammar()
        if g is None:
            return None
        if self.tokenizer is None:
            raise ValueError("ToolSpec.constraint() needs the tokenizer")
        return Constraint(self.tokenizer, g, "tools")

    @property
    def trigger(self) -> Optional[str]:
        """the text that opens a call (None: the whole reply is the call, generic format)"""
        return {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": '{"name"'}.get(self.format)

    # ------------------------------------------------------------------ output
    def parse(self, text: str) -> Tuple[Optional[str], Optional[List[dict]]]:
        """(content, tool_calls) of a reply's text (special tokens rendered). tool_calls None: no
        call (the text is content); content None: nothing but calls. A call cut short (max_tokens)
        is no call: the text stays content."""
        if self.choice == "none":
            return text, None
        try:
            content, calls = self._parse(text)
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, None
        if not calls:
            return (text if content is None else content), None
        allowed = {t["function"]["name"] for t in self.tools}
        out = []
        for name, args in calls:
            if not isinstance(name, str) or name not in allowed or not isinstance(args, dict):
                return text, None
            out.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        if not self.parallel:
            out = out[:1]
        content = content.strip() if content else None
        return (content or None), out

    def _parse(self, text: str):
        dec = json.JSONDecoder()
        if self.format == "generic":
            obj = json.loads(text)
            if "response" in obj:
                return obj["response"], None
            if "tool_call" in obj:
                c = obj["tool_call"]
                return None, [(c["name"], c["arguments"])]
            return None, [(c["name"], c["arguments"]) for c in obj["tool_calls"]]
        trig = self.trigger if self.format != "llama3" else "{"
        k = text.find(self.trigger)
        if k < 0:
            return text, None
        content, rest, calls = text[:k], text[k:], []
        if self.format == "mistral":
            arr, end = dec.raw_decode(rest[len(trig):].lstrip())
            calls = [(c["name"], c["arguments"]) for c in arr]
        else:
            while rest.strip():
                rest = rest.lstrip()
                if self.format == "hermes":
                    if not rest.startswith(trig):
                        raise ValueError("text after a call")
                    body = rest[len(trig):].lstrip()
                    obj, end = dec.raw_decode(body)
                    after = body[end:].lstrip()
                    if not after.startswith("</tool_call>"):
                        raise ValueError("unclosed call")
                    rest = after[len("</tool_call>"):]
                    calls.append((obj["name"], obj["arguments"]))
                else:
                    obj, end = dec.raw_decode(rest)
                    rest = rest[end:]
                    calls.append((obj["name"], obj.get("parameters", obj.get("arguments"))))
        return content, calls


class ToolStream:
    """Streamed text of a tool request: push(text) -> content to send now; finish() ->
    (content left, tool_calls or None). Content is sent as it comes until a call may begin (text
    that could be the start of the call's opening is held back); a call's text is kept until the
    end, when the reply is parsed. Fully constrained choices and the generic format send content
    only at the end."""

    def __init__(self, spec: ToolSpec):
        self.spec = spec
        self.text = ""
        self.sent = 0
        self.held = spec.choice in ("required", "named") or spec.trigger is None
        self.trigger = spec.trigger if spec.choice != "none" else None

    def push(self, piece: str) -> str:
        self.text += piece
        if self.spec.choice == "none":
            self.sent = len(self.text)
            return piece
        if self.held:
            return ""
        t = self.trigger
        k = self.text.find(t, self.sent)
        if k >= 0:
            out, self.sent, self.held = self.text[self.sent:k], k, True
            return out
        hold = 0
        for n in range(min(len(t) - 1, len(self.text) - self.sent), 0, -1):
            if self.text.endswith(t[:n]):
                hold = n
                break
        cut = len(self.text) - hold
        out, self.sent = self.text[self.sent:cut], cut
        return out

    def finish(self) -> Tuple[Optional[str], Optional[List[dict]]]:
        content, calls = self.spec.parse(self.text)
        if calls is None:                  # the unsent rest (generic: nothing was sent, the parsed answer)
            return ((content if not self.sent else self.text[self.sent:]) or None), None
        # content before the call was sent already
        return None if self.sent else content, calls


def guide_generate(model, prompt, sampler, response_format=None, grammar=None, tools=None, tool_choice=None,
                   parallel_tool_calls=None):
    """Model.generate's constraint arguments -> (prompt, sampler, ToolSpec or None): chat messages
    rendered with the tools, the sampler wrapped in a GuidedSampler."""
    from .constrain import GuidedSampler
    from .sampling import Sampler
    tok = model.tokenizer
    spec = None
    if tools is not None:
        if response_format is not None or grammar is not None:
            tc = tool_choice if not isinstance(tool_choice, dict) else "named"
            if tc not in (None, "none"):
                raise ValueError("tools with tool_choice other than 'none' cannot be combined with "
                                 "response_format or grammar")
        spec = ToolSpec(tools, tool_choice, parallel_tool_calls, template=tok.chat_template, tokenizer=tok)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            from .chat import chat_prompt
            msgs, extra = spec.messages(list(prompt))
            text = chat_prompt(tok, msgs, add_generation_prompt=True, **extra)
            prompt = model.tokenize(text, add_bos=False, special=True)
    elif tool_choice is not None or parallel_tool_calls is not None:
        raise ValueError("tool_choice and parallel_tool_calls need tools")
    c = Constraint.from_options(tok, response_format=response_format, grammar=grammar)
    if spec is not None and spec.choice != "none":
        c = spec.constraint()
    if c is None:
        return prompt, sampler, spec
    if sampler is None:
        raise ValueError("internal: no sampler")
    if isinstance(sampler, GuidedSampler):
        raise ValueError("sampler is already a GuidedSampler: pass the constraint there, not both")
    if not isinstance(sampler, Sampler) and not hasattr(sampler, "sample"):
        raise TypeError(f"sampler must be a Sampler, got {type(sampler).__name__}")
    return prompt, GuidedSampler(sampler, c), spec


def with_tool_calls(gen, spec, tokenizer):
    """a generate() loop whose GenerationResult gets .tool_calls (and .text the content) parsed"""
    res = yield from gen
    content, calls = spec.parse(tokenizer.detokenize(res.tokens, special=True))
    if calls is not None:
        res.tool_calls = calls
        res.text = content or ""
    return res

"""Chat-template rendering (docs/semantics.md §10), as llama-cpp-python / HF transformers do it.

``render_chat(template, messages, ...)`` renders a GGUF ``tokenizer.chat_template`` with jinja2:
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)``, the ``loopcontrols``
extension, an extension that ignores ``{% generation %}`` tags, a ``tojson`` filter that calls
``json.dumps(ensure_ascii=False)``, and the globals ``raise_exception(msg)`` (raises
``TemplateError``, a ``ValueError``) and ``strftime_now(fmt)``. Template variables: ``messages``,
``bos_token``, ``eos_token``, ``add_generation_prompt`` plus any extra keyword (``tools``, ...).

With no template (``None`` or ``""``) the ChatML template ``CHATML_TEMPLATE`` is used. (Note:
llama-cpp-python itself falls back to its "llama-2" format; ChatML is the cpufuse choice.)

Limits. A template comes from a GGUF file, untrusted: the sandbox stops escapes, not CPU or
memory, so rendering also gets a time limit (``time_limit`` seconds, default 1) and a size limit
(``max_chars`` characters, default 2**24) and raises ``TemplateLimitError`` (a ``TemplateError``)
past either. The clock is checked at every loop iteration (each ``for`` iterable is wrapped in a
guard when the template is parsed), call, attribute or item access, intercepted operator and
output chunk; the size of every call's, filter's and operator's result and of the output so far
is checked, and ``str * n`` or ``n ** m`` whose result would be too large is refused before it is
computed. Recursion too deep, MemoryError and OverflowError also become ``TemplateLimitError``.
Constant folding is off (jinja2 would otherwise run filters on constants at compile time, outside
the limits), and a template longer than ``MAX_TEMPLATE_CHARS`` is refused.

The rendered prompt is meant to be tokenized with ``add_bos=False, special=True`` (what
llama-cpp-python does): the template emits BOS itself if the model wants it.
"""
from __future__ import annotations

import contextvars
import datetime
import functools
import json
import math
import time
from typing import Any, Optional

__all__ = ["render_chat", "chat_prompt", "CHATML_TEMPLATE", "TemplateError", "TemplateLimitError",
           "DEFAULT_TIME_LIMIT", "DEFAULT_MAX_CHARS"]

DEFAULT_TIME_LIMIT = 1.0          # seconds
DEFAULT_MAX_CHARS = 1 << 24       # characters of output (and of any one value made on the way)
MAX_TEMPLATE_CHARS = 1 << 20      # the template's own text (real ones are a few KB)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# The Gemma turn format, for GGUFs with no template of their own whose vocabulary has
# <start_of_turn> (llama.cpp's built-in Gemma fallback does the same): BOS, a leading system
# message prefixed (+ "\n\n") to the first user turn, user/assistant alternating with "assistant"
# renamed "model", each turn "<start_of_turn>{role}\n{content|trim}<end_of_turn>\n", and the
# generation prompt "<start_of_turn>model\n". The rendered BOS is the only one: chat prompts are
# tokenized with add_bos=False.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Gemma: roles must alternate user/assistant/user/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


class TemplateError(ValueError):
    """Raised by a template's ``raise_exception(msg)``."""


class TemplateLimitError(TemplateError):
    """A chat template ran past its time limit or made a value or an output past its size limit."""


# (deadline, max_chars, time_limit) of the rendering running in this thread/context, or None
_LIMITS = contextvars.ContextVar("cpufuse_chat_limits", default=None)
_SIZED = (str, bytes, list, tuple, dict)
_WIDTH_METHODS = frozenset(("center", "ljust", "rjust", "zfill", "expandtabs"))
_WIDTH_FILTERS = frozenset(("center", "indent", "wordwrap", "truncate"))


def _tick():
    lim = _LIMITS.get()
    if lim is not None and time.monotonic() > lim[0]:
        raise TemplateLimitError(f"chat template rendering exceeded its time limit of {lim[2]} s")


def _too_big(n, what):
    lim = _LIMITS.get()
    if lim is not None and n > lim[1]:
        raise TemplateLimitError(f"chat template: {what} of {n} items or characters exceeds the limit of "
                                 f"{lim[1]} (max_chars)")


def _check_size(v, what):
    if isinstance(v, _SIZED):
        _too_big(len(v), what)
    return v


def _content_size(v, budget, memo=None):
    """characters of the strings inside v plus one per item, counted until past budget (a
    container's text can be far larger than its len: [messages] * 10000); a container met again
    (a repetition holds the same objects) is counted from memo, not walked again"""
    if isinstance(v, (str, bytes)):
        return len(v)
    if not isinstance(v, (list, tuple, dict, set, frozenset)):
        return 1
    memo = {} if memo is None else memo
    k = id(v)
    if k in memo:
        return memo[k]
    memo[k] = budget + 1                     # a container inside itself counts as too big
    n, prev, prev_n = len(v), None, 0
    for x in (list(v.keys()) + list(v.values()) if isinstance(v, dict) else v):
        if x is not prev:
            prev, prev_n = x, _content_size(x, budget, memo)
        n += prev_n
        if n > budget:
            break
    memo[k] = n
    return n


def _finalize(v):
    """every {{ }} value before it becomes text: a container's text is bounded too"""
    lim = _LIMITS.get()
    if lim is not None and isinstance(v, (list, tuple, dict, set, frozenset)):
        _too_big(_content_size(v, lim[1]), "an output value's text")
    return v


def _check_width_args(args, kwargs, what):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool):
            _too_big(a, what + " width")


def _loop_guard(context, iterable):
    """every for-loop's iterable, wrapped at parse time: the clock is read on the first item and
    then every 256 items"""
    lim = _LIMITS.get()
    if lim is None:
        yield from iterable
        return
    deadline, mono = lim[0], time.monotonic
    for i, x in enumerate(iterable):
        if not i & 255 and mono() > deadline:
            raise TemplateLimitError(f"chat template rendering exceeded its time limit of {lim[2]} s")
        yield x


def _raise_exception(message: str):
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=None)
def _environment():
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover
        raise ImportError("cpufuse.llama.chat needs the 'jinja2' package (pip install jinja2)") \
            from e

    class _GenerationTagIgnored(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class _LimitedSandbox(ImmutableSandboxedEnvironment):
        """the immutable sandbox, with the clock and size checks of the module docstring"""
        intercepted_binops = frozenset(("*", "**", "+", "%", "//"))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            _tick()
            if getattr(__obj, "__name__", None) in _WIDTH_METHODS and isinstance(
                    getattr(__obj, "__self__", None), (str, bytes)):
                _check_width_args(args, kwargs, f"str.{__obj.__name__}")
            return _check_size(super().call(__context, __obj, *args, **kwargs), "a call's result")

        def getattr(self, obj, attribute):
            _tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _tick()
            return super().getitem(obj, argument)

        def call_binop(self, context, operator, left, right):
            _tick()
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, _SIZED) and isinstance(b, int) and not isinstance(b, bool):
                        lim = _LIMITS.get()
                        size = len(a) if isinstance(a, (str, bytes)) or lim is None else \
                            _content_size(a, lim[1] // max(1, b) + 1)
                        _too_big(size * b, "a repetition")
            elif operator == "**" and type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
                bits = right * math.log2(abs(left))
                if bits > 64 * 1024:
                    raise TemplateLimitError(f"chat template: {left} ** {right} would have ~{bits:.3g} bits "
                                             "(limit 65536)")
            return _check_size(super().call_binop(context, operator, left, right), f"a {operator!r} result")

        def _parse(self, source, name, filename):
            tree = super()._parse(source, name, filename)
            for node in tree.find_all(nodes.For):
                node.iter = nodes.Filter(node.iter, "cf_loop_guard", [], [], None, None, lineno=node.lineno)
            return tree

    env = _LimitedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        optimized=False,            # no constant folding: it would run filters at compile time, unlimited
        extensions=[_GenerationTagIgnored, jinja2.ext.loopcontrols],
        finalize=_finalize,
    )
    env.filters["tojson"] = _tojson
    for fname, f in list(env.filters.items()):
        env.filters[fname] = _limited_filter(fname, f)
    env.filters["cf_loop_guard"] = jinja2.pass_context(_loop_guard)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    # jinja2's lipsum(n) makes n paragraphs in one call, past the clock checks (the fuzzer's find:
    # lipsum(5011) ran 4 s); no chat template uses it
    del env.globals["lipsum"]
    return env


def _limited_filter(name, f):
    """a filter with the clock read first and its result's size checked (and, for the filters
    that pad to a width, the width checked first). The wrapper takes the context (pass_context),
    which also stops jinja2 from calling the filter on constants at compile time (outside the
    limits), and hands f what f asked for (its own pass_* mark)."""
    import jinja2
    pass_arg = getattr(getattr(f, "jinja_pass_arg", None), "name", None)
    width = name in _WIDTH_FILTERS

    def g(context, *args, **kwargs):
        _tick()
        if width:
            _check_width_args(args[1:], kwargs, f"filter {name}")
        if pass_arg == "context":
            r = f(context, *args, **kwargs)
        elif pass_arg == "eval_context":
            r = f(context.eval_ctx, *args, **kwargs)
        elif pass_arg == "environment":
            r = f(context.environment, *args, **kwargs)
        else:
            r = f(*args, **kwargs)
        return _check_size(r, f"filter {name}'s result")
    g.__name__ = getattr(f, "__name__", name)
    return jinja2.pass_context(g)


@functools.lru_cache(maxsize=32)
def _compile(template: str):
    return _environment().from_string(template)


def render_chat(template: Optional[str], messages: list, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", *, time_limit: float = DEFAULT_TIME_LIMIT,
                max_chars: int = DEFAULT_MAX_CHARS, **kwargs: Any) -> str:
    """Render ``messages`` (list of ``{"role": ..., "content": ...}``) with a Jinja chat template.

    ``template`` None/"" -> ChatML. ``bos_token`` / ``eos_token`` are the token *texts*
    (``Tokenizer.bos_text`` / ``eos_text``). Extra keyword arguments become template variables.
    ``time_limit`` (seconds, from the start of rendering; compiling is not counted) and
    ``max_chars`` bound the rendering: past either, ``TemplateLimitError``.
    """
    if not template:
        template = CHATML_TEMPLATE
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"chat template of {len(template)} characters is longer than the limit of "
                                 f"{MAX_TEMPLATE_CHARS}")
    time_limit = float(time_limit)
    if not (time_limit > 0 and math.isfinite(time_limit)):
        raise ValueError(f"time_limit must be finite and > 0, got {time_limit}")
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"max_chars must be an integer >= 1, got {max_chars!r}")
    tmpl = _compile(template)
    token = _LIMITS.set((time.monotonic() + time_limit, max_chars, time_limit))
    try:
        parts, n = [], 0
        for chunk in tmpl.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=bos_token, eos_token=eos_token, **kwargs):
            n += len(chunk)
            _too_big(n, "the rendered prompt")
            _tick()
            parts.append(chunk)
        return "".join(parts)
    except RecursionError:
        raise TemplateLimitError("chat template: recursion too deep") from None
    except (MemoryError, OverflowError) as e:
        raise TemplateLimitError(f"chat template: {type(e).__name__}: {e}") from None
    finally:
        _LIMITS.reset(token)


def chat_prompt(tokenizer, messages: list, add_generation_prompt: bool = True,
                template: Optional[str] = None, **kwargs: Any) -> str:
    """Render with the tokenizer's GGUF template (or ``template``), its BOS/EOS texts
    (``time_limit`` and ``max_chars`` as in ``render_chat``)."""
    tpl = template if template is not None else getattr(tokenizer, "chat_template", None)
    return render_chat(tpl, messages, add_generation_prompt=add_generation_prompt,
                       bos_token=tokenizer.bos_text, eos_token=tokenizer.eos_text, **kwargs)

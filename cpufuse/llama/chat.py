"""Chat-template rendering (SPEC-MODEL §4.7), as llama-cpp-python / HF transformers do it.

``render_chat(template, messages, ...)`` renders a GGUF ``tokenizer.chat_template`` with jinja2:
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)``, the ``loopcontrols``
extension, an extension that ignores ``{% generation %}`` tags, a ``tojson`` filter that calls
``json.dumps(ensure_ascii=False)``, and the globals ``raise_exception(msg)`` (raises
``TemplateError``, a ``ValueError``) and ``strftime_now(fmt)``. Template variables: ``messages``,
``bos_token``, ``eos_token``, ``add_generation_prompt`` plus any extra keyword (``tools``, ...).

With no template (``None`` or ``""``) the ChatML template ``CHATML_TEMPLATE`` is used. (Note:
llama-cpp-python itself falls back to its "llama-2" format; ChatML is the cpufuse choice.)

The rendered prompt is meant to be tokenized with ``add_bos=False, special=True`` (what
llama-cpp-python does): the template emits BOS itself if the model wants it.
"""
from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Optional

__all__ = ["render_chat", "chat_prompt", "CHATML_TEMPLATE", "TemplateError"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ValueError):
    """Raised by a template's ``raise_exception(msg)``."""


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

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTagIgnored, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile(template: str):
    return _environment().from_string(template)


def render_chat(template: Optional[str], messages: list, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **kwargs: Any) -> str:
    """Render ``messages`` (list of ``{"role": ..., "content": ...}``) with a Jinja chat template.

    ``template`` None/"" -> ChatML. ``bos_token`` / ``eos_token`` are the token *texts*
    (``Tokenizer.bos_text`` / ``eos_text``). Extra keyword arguments become template variables.
    """
    if not template:
        template = CHATML_TEMPLATE
    return _compile(template).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **kwargs,
    )


def chat_prompt(tokenizer, messages: list, add_generation_prompt: bool = True,
                template: Optional[str] = None, **kwargs: Any) -> str:
    """Render with the tokenizer's GGUF template (or ``template``), its BOS/EOS texts."""
    tpl = template if template is not None else getattr(tokenizer, "chat_template", None)
    return render_chat(tpl, messages, add_generation_prompt=add_generation_prompt,
                       bos_token=tokenizer.bos_text, eos_token=tokenizer.eos_text, **kwargs)

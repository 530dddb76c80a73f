"""Inputs the fuzzers (tests/fuzz_inputs.py, make fuzz-gguf) found, kept as regression tests."""
import time

import pytest

pytest.importorskip("jinja2", reason="the llama extra (pip install cpufuse[llama]) is not installed")

from cpufuse.llama.chat import render_chat  # noqa: E402


@pytest.mark.parametrize("template", [
    "{{ lipsum(5011) }}",                                  # build/fuzz/template/timeout-f6a1fea4...
    "{{ range(10)|list }}{{ lipsum(5011) }}{ lipsum(1000) }}",
])
def test_template_lipsum_cannot_outrun_the_time_limit(template):
    """jinja2's lipsum(n) made n paragraphs in one call, which the per-call clock check could not
    stop (4 s at n = 5011): it is not offered to templates."""
    t0 = time.perf_counter()
    with pytest.raises(Exception, match="lipsum"):
        render_chat(template, [{"role": "user", "content": "hi"}], time_limit=1.0)
    assert time.perf_counter() - t0 < 1.0


def test_template_container_repetition_is_bounded_by_its_text():
    """build/fuzz/template/timeout-58690611...: {{ messages * 10000 }} with three 1 MiB messages
    made a list of 30000 items (under the limit by len) whose text was 30 GB; the repetition and the
    output are bounded by the text inside, so it is refused at once"""
    msgs = [{"role": "user", "content": "x" * (1 << 20)}] * 3
    t0 = time.perf_counter()
    for template in ("{{ messages * 10000 }}", "{% set a = [messages, messages] %}{{ a }}{{ a }}"):
        with pytest.raises(Exception, match="limit"):
            render_chat(template, msgs * 4, time_limit=1.0)
    assert time.perf_counter() - t0 < 2.0
    assert render_chat("{{ messages * 2 }}", [{"role": "user", "content": "hi"}]).count("'hi'") == 2


def test_template_repetition_of_many_small_items_is_quick():
    """build/fuzz/template/timeout-b1632c30...: {{ messages * 100000 }} of one short message is
    within the size limit; checking its text size walks the one dict once, not 100000 times"""
    t0 = time.perf_counter()
    out = render_chat("{{ messages * 100000 }}", [{"role": "user", "content": "x" * 16}], time_limit=1.0)
    assert out.count("x" * 16) == 100000 and time.perf_counter() - t0 < 1.0

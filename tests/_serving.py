"""Helpers of the server tests: a free port, an in-process uvicorn, polling."""
import contextlib
import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live(app, log_level="warning"):
    """uvicorn serving the ASGI `app` in a thread (no signal handling) on a free port: yields the
    base URL; stops the server on exit"""
    import uvicorn
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", log_level=log_level,
                                           timeout_graceful_shutdown=1))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not server.started:
        assert t.is_alive() and time.time() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(30)


def collect(handle):
    """(token ids, the FinishEvent) of an engine handle consumed without a loop"""
    from cpufuse.serve.engine import TokenEvent
    toks, fin = [], None
    for ev in handle:
        if isinstance(ev, TokenEvent):
            toks.append(ev.token)
        else:
            fin = ev
    return toks, fin


@contextlib.contextmanager
def request_log():
    """the lines of the server's request log (logger cpufuse.serve, at INFO) while the block runs"""
    import logging
    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    log, h = logging.getLogger("cpufuse.serve"), Lines()
    level = log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(h)
        log.setLevel(level)


def until(cond, timeout=20, what="the condition"):
    """poll cond() every 10 ms until it is true; AssertionError after `timeout` seconds"""
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, f"{what} was never met"
        time.sleep(0.01)

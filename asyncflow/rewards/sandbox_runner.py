"""The sandboxed code's own interpreter, and the wire between it and the tests' process.

Stdlib only. The code's process runs `python -I -c <this file's text> NOTES_FD CODE_FILE MODE
[REQUEST_FD ANSWER_FD]`, a fresh interpreter whose memory holds nothing of the sandbox's (no
report descriptor, no nonce, no tests). With tests, the tests run in another process (sandbox_boot.py
executes this text there for `ask`): it sees the code's module through plain values and handles,
and every call, attribute and item goes over two pipes to this process, which answers with a plain
value (None, bool, int, float, complex, str, bytes, and lists, tuples, dicts, sets, frozensets and
ranges of them, exact types only) or a handle. A handle cannot be compared, so an object that says
it equals everything never reaches an `==` of the tests.
"""
import json
import os
import sys

MAX_MESSAGE = 16 * 2**20
MAX_DEPTH = 100
MAX_ITEMS = 1_000_000
_SCALARS = (type(None), bool, str, float)
_SEQUENCES: dict = {list: "l", tuple: "t", set: "s", frozenset: "f"}


class NotPlain(Exception):
    """A value that does not cross the wire as a value (it goes as a handle)."""


def encode(value, handle=None, depth=0):
    """`value` as JSON-able data; values that are not plain become `handle(value)` (a dict
    {"h": id}), or raise NotPlain when `handle` is None."""
    kind = type(value)
    if depth > MAX_DEPTH:
        raise NotPlain("nested too deeply")
    if kind in _SCALARS:
        return value
    if kind is int:
        return value if value.bit_length() < 4000 else {"i": format(value, "x")}
    if kind in _SEQUENCES:
        if len(value) > MAX_ITEMS:
            raise NotPlain("too many items")
        return {_SEQUENCES[kind]: [encode(v, handle, depth + 1) for v in value]}
    if kind is dict:
        if len(value) > MAX_ITEMS:
            raise NotPlain("too many items")
        return {"d": [[encode(k, None, depth + 1), encode(v, handle, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    if kind is range:
        return {"r": [value.start, value.stop, value.step]}
    if handle is None:
        raise NotPlain(f"a {kind.__name__} is not a plain value")
    return handle(value)


def decode(data, handle=None):
    """The value `encode` gave; {"h": id} becomes `handle(id)` (or raises NotPlain without one)."""
    if not isinstance(data, dict):
        return data
    if len(data) != 1:
        raise NotPlain("malformed value")
    (tag, body), = data.items()
    if tag == "h":
        if handle is None:
            raise NotPlain("a handle where a plain value was expected")
        return handle(body)
    if tag == "d":
        return {decode(k): decode(v, handle) for k, v in body}
    if tag in ("l", "t", "s", "f"):
        items = [decode(v, handle) for v in body]
        return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](items)
    if tag == "i":
        return int(body, 16)
    if tag == "b":
        return bytes.fromhex(body)
    if tag == "c":
        return complex(*body)
    if tag == "r":
        return range(*body)
    raise NotPlain("unknown tag " + repr(tag))


class Line:
    """Newline-framed JSON messages on a pipe, at most MAX_MESSAGE bytes each."""

    def __init__(self, read_fd, write_fd):
        self.rfd, self.wfd, self.buf = read_fd, write_fd, b""

    def send(self, msg):
        data = (json.dumps(msg) + "\n").encode()
        while data:
            data = data[os.write(self.wfd, data):]

    def recv(self):
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_MESSAGE:
                raise EOFError("a message over the size limit")
            chunk = os.read(self.rfd, 1 << 16)
            if not chunk:
                raise EOFError("the other side closed the pipe")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


# ---- the code's side ----------------------------------------------------------------------------

def _guard_sockets():
    """Every Python name of the socket constructors raises before a socket exists (the seccomp
    filter, where the kernel has one, refuses the system call itself); counts the attempts."""
    import _socket
    import socket

    class NetworkBlocked(PermissionError):
        pass

    attempts = [0]

    class _NoSocket:
        def __init__(self, *args, **kwargs):
            attempts[0] += 1
            raise NetworkBlocked("network access is disabled in the sandbox")

    for mod in (socket, _socket):
        for name in ("socket", "SocketType", "socketpair", "create_connection", "create_server", "fromfd"):
            if hasattr(mod, name):
                setattr(mod, name, _NoSocket)
    return NetworkBlocked, attempts


def _serve(link, module, NetworkBlocked):
    """Answer the tests' requests until they close the pipe."""
    objs: list = []

    def handle(value):
        if len(objs) >= MAX_ITEMS:
            raise NotPlain("too many handles")
        objs.append(value)
        return {"h": len(objs) - 1}

    names = {k: v for k, v in vars(module).items() if not (k.startswith("__") and k.endswith("__"))}
    link.send({"names": {k: encode(v, handle) for k, v in list(names.items())[:10_000]}})
    while True:
        try:
            req = link.recv()
        except (EOFError, ValueError):
            return
        link.send(_answer(lambda req=req: _apply(req, objs), handle, NetworkBlocked))


def _apply(req, objs):
    def arg(x):
        return decode(x, objs.__getitem__)
    target = objs[req["h"]]
    op = req["op"]
    if op == "call":
        return target(*arg(req["args"]), **arg(req["kwargs"]))
    if op == "getattr":
        return getattr(target, req["name"])
    if op == "getitem":
        return target[arg(req["key"])]
    if op == "len":
        return len(target)
    if op == "bool":
        return bool(target)
    if op == "contains":
        return arg(req["key"]) in target
    if op == "repr":
        return repr(target) if req.get("repr", True) else str(target)
    if op == "iter":
        return [x for _, x in zip(range(MAX_ITEMS), target, strict=False)]
    if op == "next":
        return next(target)
    raise ValueError("unknown request " + repr(op))


def _answer(work, handle, NetworkBlocked=()):
    try:
        return {"v": encode(work(), handle)}
    except NetworkBlocked as exc:
        return {"raise": "PermissionError", "msg": str(exc)}
    except BaseException as exc:  # the code's exception, for the tests to see (SystemExit included)
        return {"raise": type(exc).__name__, "msg": str(exc)[:2000]}


def _run_module(code_file, mode, link, NetworkBlocked):
    import types
    module = types.ModuleType("__main__" if mode == "main" else "solution")
    module.__file__ = code_file
    module.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    sys.argv = [code_file]
    with open(code_file) as f:
        source = f.read()
    exec(compile(source, "<solution>", "exec"), module.__dict__)
    if link is not None:
        _serve(link, module, NetworkBlocked)


def _outcome(run, NetworkBlocked):
    """(exit code, limit hit or None) of `run()`, printing what the interpreter would."""
    try:
        run()
    except MemoryError:
        sys.stderr.write("MemoryError: the sandbox memory limit was reached\n")
        return 1, "memory"
    except NetworkBlocked as exc:
        sys.stderr.write(f"NetworkBlocked: {exc}\n")
        return 1, "network"
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            sys.stderr.write(f"{exc.code}\n")  # as the interpreter prints sys.exit("message")
        return (exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)), None
    except BaseException as exc:
        import traceback
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":  # hide this runner's frames
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        return 1, None
    return 0, None


def main(argv):
    """Run the code as a real module (`__main__`, or `solution` serving the tests), then, as at a
    normal interpreter exit, join its non-daemon threads and run its atexit functions. Never returns."""
    import atexit
    import threading
    notes_fd, code_file, mode = int(argv[0]), argv[1], argv[2]
    link = Line(int(argv[3]), int(argv[4])) if len(argv) > 4 else None
    NetworkBlocked, attempts = _guard_sockets()
    code, limit = _outcome(lambda: _run_module(code_file, mode, link, NetworkBlocked), NetworkBlocked)
    try:
        if link is not None:
            os.close(link.wfd)  # the tests see the end even when the module failed
        try:
            for t in threading.enumerate():
                if t is not threading.main_thread() and not t.daemon:
                    t.join()
            atexit._run_exitfuncs()
        except BaseException:
            pass
        notes = os.fdopen(notes_fd, "w")
        notes.write(json.dumps({"limit": limit, "network_attempts": attempts[0]}) + "\n")
        notes.flush()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


# ---- the tests' side ----------------------------------------------------------------------------

class SolutionError(RuntimeError):
    """An exception of the solution's own class, raised in the tests by its name and message."""


class Remote:
    """A handle on one of the code's objects: calls, attributes, items, length, iteration and
    truth go to the code's process; comparing it raises (compare plain values instead)."""

    __slots__ = ("_link", "_h")

    def __init__(self, link, h):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_h", h)

    def _ask(self, op, **fields):
        link = object.__getattribute__(self, "_link")
        link.send({"op": op, "h": object.__getattribute__(self, "_h"), **fields})
        answer = link.recv()
        if "raise" in answer:
            _reraise(answer["raise"], answer.get("msg", ""))
        return decode(answer["v"], lambda h: Remote(link, h))

    def __call__(self, *args, **kwargs):
        return self._ask("call", args=_plain(list(args)), kwargs=_plain(kwargs))

    def __getattr__(self, name):
        return self._ask("getattr", name=name)

    def __getitem__(self, key):
        return self._ask("getitem", key=_plain(key))

    def __contains__(self, key):
        return self._ask("contains", key=_plain(key))

    def __len__(self):
        return self._ask("len")

    def __bool__(self):
        return self._ask("bool")

    def __iter__(self):
        return iter(self._ask("iter"))

    def __next__(self):
        return self._ask("next")

    def __repr__(self):
        return self._ask("repr")

    def __str__(self):
        return self._ask("repr", repr=False)

    def __eq__(self, other):
        raise TypeError("run_tests: an object of the solution cannot be compared; compare plain values "
                        "(numbers, strings, lists, dicts, ...) it returns")

    __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__
    __hash__ = None  # type: ignore[assignment]


def _plain(value):
    return encode(value, _handle_of)


def _handle_of(value):
    if type(value) is Remote:
        return {"h": object.__getattribute__(value, "_h")}
    raise NotPlain(f"run_tests: a {type(value).__name__} cannot be passed to the solution (plain values only)")


def _reraise(name, msg):
    import builtins
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        raise cls(msg)
    raise SolutionError(f"{name}: {msg}")


def ask(tests, link, say):
    """Run each test against the code's module (its names as plain values or handles) and `say`
    whether it passed; nothing runs when the module never loaded."""
    import builtins
    try:
        names = link.recv()["names"]
    except (EOFError, ValueError, KeyError, TypeError):
        return
    ns = {"__builtins__": builtins, "__name__": "solution_tests"}
    ns.update({k: decode(v, lambda h: Remote(link, h)) for k, v in names.items()})
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {i}>", "exec"), ns)
            ok = True
        except BaseException as exc:
            ok = False
            print(f"test {i} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        say({"test": i, "passed": ok})


if __name__ == "__main__":
    main(sys.argv[1:])

"""`run_tests`: the tests run in a process the code cannot reach, against the code's module through
plain values and handles, so the code can neither forge a result nor read the tests."""

from __future__ import annotations

import pytest

from asyncflow.rewards.sandbox import run_code, run_tests


def test_the_code_cannot_forge_results_through_the_interpreter() -> None:
    """The nonce and the report were in the code's own process: reachable from its caller's frame
    or through gc, so code that defined nothing scored 1.0."""
    forge = ("import gc, json, os, re, sys\n"
             "found = {s for s in gc.get_objects() if isinstance(s, str) and re.fullmatch('[0-9a-f]{32}', s)}\n"
             "frame, seen = sys._getframe(), []\n"
             "while frame is not None:\n    seen += list(frame.f_locals)\n"
             "    for i in range(2) if callable(frame.f_locals.get('say')) else ():\n"
             "        frame.f_locals['say']({'test': i, 'passed': True})\n"
             "    frame = frame.f_back\n"
             "for fd in map(int, os.listdir('/proc/self/fd')):\n"
             "    for nonce in found or {''}:\n        for i in range(2):\n            try:\n"
             "                os.write(fd, (json.dumps({'test': i, 'passed': True, 'nonce': nonce}) + '\\n').encode())\n"
             "            except OSError:\n                pass\n"
             "print(len(found), 'say' in seen, 'nonce' in seen)\n")
    res = run_code(forge, tests=["assert add(1, 2) == 3", "assert add(2, 2) == 4"])
    assert res.tests_passed == [False, False] and res.stdout.endswith("0 False False\n"), res.stdout


def test_the_code_cannot_read_the_tests() -> None:
    code = ("import gc\nkey = 'assert f' + '() != '\nhits = 0\nfor o in gc.get_objects():\n"
            "    items = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()\n"
            "    hits += sum(isinstance(s, str) and key in s and s != key for s in items)\n"
            "print(hits)\ndef f():\n    return 1\n")
    res = run_code(code, tests=["assert f() != 'SECRET_EXPECTED'"])
    assert res.tests_passed == [True] and res.stdout == "0\n"


def test_an_object_that_equals_everything_fails_the_tests() -> None:
    code = ("class Any:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
            "def add(a, b):\n    return Any()\n")
    res = run_code(code, tests=["assert add(1, 2) == 3"])
    assert res.tests_passed == [False] and "cannot be compared" in res.stderr


def test_tests_use_functions_classes_values_and_exceptions_of_the_solution() -> None:
    code = ("LIMIT = 10\nclass Solution:\n    def two_sum(self, nums, target):\n"
            "        seen = {}\n        for i, n in enumerate(nums):\n            if target - n in seen:\n"
            "                return [seen[target - n], i]\n            seen[n] = i\n"
            "def check(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n"
            "def squares(n):\n    yield from (i * i for i in range(n))\n"
            "def mixed():\n    print('called')\n    return {'a': (1, 2.5), 'b': {3}, 'c': b'x', 'd': None, 'e': 2 ** 100}\n"
            "class Node:\n    def __init__(self, v, nxt=None):\n        self.v, self.nxt = v, nxt\n"
            "def chain():\n    return Node(1, Node(2))\n")
    tests = ["assert LIMIT == 10",
             "assert Solution().two_sum([2, 7, 11], 9) == [0, 1]",
             "try:\n    check(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\nelse:\n    assert False",
             "assert list(squares(4)) == [0, 1, 4, 9] and all(x >= 0 for x in squares(3))",
             "assert mixed() == {'a': (1, 2.5), 'b': {3}, 'c': b'x', 'd': None, 'e': 2 ** 100}",
             "n = chain()\nassert n.v == 1 and n.nxt.v == 2 and n.nxt.nxt is None",
             "assert check(x=3) == 3",
             "assert check(-1) == 0"]
    res = run_code(code, tests=tests)
    assert res.tests_passed == [True] * 7 + [False], res.stderr
    assert res.stdout == "called\n" and "test 7 failed: ValueError: negative" in res.stderr


def test_a_solution_that_crashes_or_hangs_in_a_call_fails_only_that_test() -> None:
    code = "import os\ndef f(x):\n    if x == 0:\n        os._exit(3)\n    return x\n"
    res = run_code(code, tests=["assert f(1) == 1", "assert f(0) == 0", "assert f(2) == 2"])
    assert res.tests_passed == [True, False, False]  # the code's process is gone after test 1
    assert run_tests("def f():\n    while True:\n        pass\n", ["assert f() == 1"], timeout_s=1) == 0.0


@pytest.mark.parametrize("value", ["lambda x: x", "object()"])
def test_only_plain_values_can_be_passed_to_the_solution(value: str) -> None:
    res = run_code("def f(x):\n    return 1\n", tests=[f"assert f({value}) == 1"])
    assert res.tests_passed == [False] and "plain values only" in res.stderr

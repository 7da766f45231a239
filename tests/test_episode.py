"""Run-length columns and the multi-turn episode's token bookkeeping (virtual clock, fake engine)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
from engine_doubles import ScriptedEngine

from asyncflow.engines.base import GenRequest, GenResult
from asyncflow.envs import Env, EnvStep
from asyncflow.runs import Runs, concat, oldest, total
from asyncflow.virtual_loop import VirtualClock, run_virtual
from asyncflow.workflow.episode import EpisodeSettings, run_episode


def test_runs_behave_like_the_list_they_encode() -> None:
    r = Runs([(7, 3), (7, 1), (1, 0), (2, 2)])
    assert r == [7, 7, 7, 7, 2, 2] and len(r) == 6 and r.pairs == [(7, 4), (2, 2)]
    assert r[0] == 7 and r[4] == 2 and r[-1] == 2 and r[-3] == 7 and r[1:5] == [7, 7, 7, 2]
    assert isinstance(r[:-1], Runs) and r[::2] == [7, 7, 2]
    with pytest.raises(IndexError):
        r[6]
    assert oldest(Runs([(3, 5), (1, 2)])) == 1 and oldest([]) == -1 and oldest([4, 2]) == 2
    assert oldest(Runs([])) == -1 and oldest(()) == -1
    assert concat([Runs([(1, 2)]), Runs([(1, 1), (0, 1)])]) == Runs([(1, 3), (0, 1)])
    assert len(concat([Runs([(1, 2)]), Runs(), Runs([(1, 1), (0, 1)])])) == 4
    assert concat([[5, 6], Runs([(1, 2)])]) == [5, 6, 1, 1]  # mixed: a plain list
    assert total(Runs([(1, 3), (0, 5)])) == 3 and total([1, 0, 1]) == 2



def test_every_runs_slice_equals_the_list_slice_and_stays_merged() -> None:
    """Slices (the episode drops a response's EOS with `ids[:-1]`) give the list's elements as
    merged runs, whichever path builds them."""
    for r in (Runs([(7, 3), (2, 2), (7, 1), (1, 4)]), Runs([(5, 1)]), Runs([(9, 6)]), Runs()):
        plain = list(r)
        for a in range(-len(plain) - 1, len(plain) + 2):
            for b in range(-len(plain) - 1, len(plain) + 2):
                got = r[a:b]
                assert isinstance(got, Runs) and list(got) == plain[a:b] and len(got) == len(plain[a:b]), (r, a, b)
                assert got.pairs == Runs([(v, 1) for v in plain[a:b]]).pairs  # no empty or split runs
        assert r[:] == plain and r[:-1] == plain[:-1]


def test_joining_two_runs_merges_the_seam_and_copies() -> None:
    """`concat` of two `Runs` (an episode's context, every turn) takes its own path: same result as
    the list, merged at the seam, lengths right, and the parts left as they were."""
    parts = [Runs([(7, 3), (1, 1)]), Runs([(1, 2), (5, 1)]), Runs([(5, 2)]), Runs()]
    for a in parts:
        for b in parts:
            before = (a.pairs, b.pairs)
            got = concat([a, b])
            assert isinstance(got, Runs) and list(got) == list(a) + list(b) and len(got) == len(a) + len(b)
            assert got.pairs == Runs(a.pairs + b.pairs).pairs  # merged: no two neighbouring runs share a value
            assert (a.pairs, b.pairs) == before and got.values is not a.values and got.counts is not a.counts


def test_an_engine_that_resolves_its_own_future_is_awaited_without_a_coroutine_per_request() -> None:
    from asyncflow.engines.base import requester
    from asyncflow.engines.sim import SimEngine

    class Plain(ScriptedEngine):
        pass

    plain = Plain([[1]])
    assert requester(plain) == plain.generate  # the default start_generate would make a task per request
    sim = SimEngine.__new__(SimEngine)
    assert requester(sim) == sim.start_generate

class _Tok:
    eos_token_id = 1

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Any) -> str:
        return "".join(chr(i) for i in ids)


class _Echo(Env):
    name = "echo"
    max_turns = 3

    def __init__(self, hang_on_step: int | None = None) -> None:
        self.steps = 0
        self.hang_on_step = hang_on_step
        self.actions: list[str] = []

    async def reset(self, row: dict[str, Any], seed: int) -> str:
        return "R"

    async def step(self, action: str) -> EnvStep:
        self.steps += 1
        self.actions.append(action)
        if self.steps == self.hang_on_step:
            await asyncio.sleep(10_000)
        return EnvStep("OB", reward=0.5, done=self.steps == 2)


def _scripted(turns: list[list[int]]) -> ScriptedEngine:
    return ScriptedEngine(turns, version=3, versions_by_call=True, capacity=1)

def _play(env: _Echo, engine: ScriptedEngine) -> Any:
    async def main(clock: VirtualClock) -> Any:
        return await run_episode(env=env, engine=engine, clock=clock, tok=_Tok(), uid=9, prompt_ids=[100, 101], row={},
                                 seed=0, settings=EpisodeSettings(8, 1.0, 60.0, 5.0))

    return run_virtual(main)


def test_episode_tokens_are_exactly_the_generated_ones_plus_masked_env_text() -> None:
    engine = _scripted([[65, 66, 1], [67, 1]])  # "AB"+EOS, then "C"+EOS
    env = _Echo()
    f = _play(env, engine).fields
    r, o, b = ord("R"), ord("O"), ord("B")
    assert list(f["response_ids"]) == [r, 65, 66, 1, o, b, 67, 1]
    assert list(f["loss_mask"]) == [0, 1, 1, 1, 0, 0, 1, 1]
    assert list(f["behavior_logprobs"]) == [0.0, -0.5, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    # env tokens take the version of the generated token before them (the first generated one before any)
    assert list(f["token_versions"]) == [1, 1, 1, 1, 1, 1, 2, 2] and f["behavior_version"] == 1
    # turn 2's prompt is the prompt plus every token so far, never re-tokenized
    assert engine.prompts == [[100, 101, r], [100, 101, r, 65, 66, 1, o, b]]
    assert env.actions == ["AB", "C"]  # the env sees the turn's text without its EOS
    assert f["reward"] == 1.0 and f["reward_error"] is None and f["turns"] == 2 and f["finish_reason"] == "stop"


class _Returns(_Echo):
    """Steps return `value` (or reset returns it, with `on_reset`)."""

    def __init__(self, value: Any, on_reset: bool = False) -> None:
        super().__init__()
        self.value, self.on_reset = value, on_reset

    async def reset(self, row: dict[str, Any], seed: int) -> str:
        return self.value if self.on_reset else "R"  # type: ignore[no-any-return]

    async def step(self, action: str) -> EnvStep:
        return self.value  # type: ignore[no-any-return]


@pytest.mark.parametrize(("value", "on_reset", "needle"), [
    (EnvStep("O", reward=float("nan")), False, "step 1 returned reward nan, expected a finite number"),
    (EnvStep("O", reward=float("inf")), False, "returned reward inf"),
    (EnvStep("O", reward="abc"), False, "returned reward 'abc'"),  # type: ignore[arg-type]
    (EnvStep("O", reward=None), False, "returned reward None"),  # type: ignore[arg-type]
    (EnvStep("O", reward=True), False, "returned reward True"),
    # beyond a float's range: OverflowError escaped the episode and stopped the rollout worker
    (EnvStep("O", reward=10**400), False, "0000, expected a finite number"),
    (EnvStep("O", done="False"), False, "returned done='False', expected True or False"),  # type: ignore[arg-type]
    (EnvStep(42), False, "step 1 observation returned int, expected the observation text"),  # type: ignore[arg-type]
    (("O", 1.0, True), False, "step 1 returned tuple, expected an EnvStep"),
    (None, True, "reset returned NoneType, expected the observation text"),
])
def test_what_an_environment_returns_is_checked_and_ends_only_its_episode(value: Any, on_reset: bool,
                                                                          needle: str) -> None:
    """Unchecked, a NaN reward made its group's advantages NaN (or silently 0 under grpo), "False"
    ended the episode as done, and a wrong type raised outside the episode's error handling: a
    traceback that stopped the run. Each is now this episode's `reward_error`."""
    f = _play(_Returns(value, on_reset), _scripted([[65, 1], [66, 1]])).fields
    assert f["reward"] is None and needle in f["reward_error"] and f["reward_error"].startswith("environment 'echo' ")


def test_an_episode_never_asks_for_more_tokens_than_the_model_has_positions_left() -> None:
    """The context grows by every turn and observation; with the model's positions known, a turn gets
    at most what is left and an episode with no room left ends as `length`. It used to send the
    request anyway: a server refused it (ending the run), a learned-position model hit an index error."""

    class _Limits(ScriptedEngine):
        async def generate(self, request: GenRequest) -> GenResult:
            self.asked = [*getattr(self, "asked", []), request.max_new_tokens]
            res = await super().generate(request)
            k = request.max_new_tokens  # an engine stops at the tokens it was asked for
            return GenResult(res.uid, res.response_ids[:k], res.behavior_logprobs[:k], res.token_versions[:k],
                             res.finish_reason if len(res.response_ids) <= k else "length")

    def play(max_context: int) -> tuple[Any, list[int]]:
        engine = _Limits([[65, 66, 1], [67, 1]])

        async def main(clock: VirtualClock) -> Any:
            return await run_episode(env=_Echo(), engine=engine, clock=clock, tok=_Tok(), uid=9, prompt_ids=[100, 101],
                                     row={}, seed=0, settings=EpisodeSettings(8, 1.0, 60.0, 5.0, max_context=max_context))

        return run_virtual(main).fields, getattr(engine, "asked", [])

    f, asked = play(9)  # prompt 2 + reset "R" 1: 6 left for turn 1; + 3 generated + "OB" 2: 1 left for turn 2
    assert asked == [6, 1] and f["turns"] == 2 and f["finish_reason"] == "stop"
    f, asked = play(8)  # no room for turn 2
    assert asked == [5] and f["turns"] == 1 and f["finish_reason"] == "length" and f["reward_error"] is None
    f, asked = play(3)  # prompt 2 + reset 1 fill the model: nothing generated, so nothing to train
    assert asked == [] and f["turns"] == 0 and f["reward"] is None
    assert f["reward_error"] == ("the prompt and the environment's first observation take 3 of the model's 3 positions: "
                                 "no room for a turn")
    for max_context in range(6, 12):  # an observation is appended only with room for it and a turn after it
        f, asked = play(max_context)  # (it was appended regardless: the sample outgrew the model's positions
        assert 2 + len(f["response_ids"]) <= max_context, max_context  # and failed the trainer)
    f, asked = play(7)  # turn 1 leaves 1 position; "OB" needs 2
    assert asked == [4] and f["finish_reason"] == "length" and list(f["response_ids"]) == [ord("R"), 65, 66, 1]


def test_a_hung_environment_ends_its_episode_with_an_error() -> None:
    f = _play(_Echo(hang_on_step=1), _scripted([[65, 1]])).fields
    assert f["reward"] is None and "hung" in f["reward_error"] and "echo" in f["reward_error"]
    assert list(f["loss_mask"]) == [0, 1, 1]  # what was generated is kept (the sample is not trained)


def test_turn_barrier_holds_every_episode_until_the_batch_arrives() -> None:
    from asyncflow.workflow.episode import TurnBarrier

    async def main(clock: VirtualClock) -> list[tuple[str, float]]:
        barrier = TurnBarrier(3, 60.0)
        log: list[tuple[str, float]] = []

        async def episode(name: str, work: list[float]) -> None:
            try:
                for w in work:
                    await clock.sleep(w)
                    await barrier.wait()
                    log.append((name, clock.now()))
            finally:
                barrier.leave()

        await asyncio.gather(episode("a", [1, 1]), episode("b", [3, 1, 1]), episode("c", [2]))
        return log

    log = run_virtual(main)
    # round 1 releases when the slowest (b, t=3) arrives; c then leaves; round 2 waits for b (t=4);
    # b's last round has only itself
    assert sorted(log) == [("a", 3.0), ("a", 4.0), ("b", 3.0), ("b", 4.0), ("b", 5.0), ("c", 3.0)]


def test_module_factory_envs_get_the_run_settings_or_are_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncflow.envs import make_env_factory
    from asyncflow.errors import UserError

    (tmp_path / "fac_envs.py").write_text(
        "from asyncflow.envs import Env, EnvStep\n"
        "class E(Env):\n"
        "    name = 'e'\n"
        "    max_turns = 9\n"
        "    def __init__(self, clock, **kw):\n"
        "        self.kw = kw\n"
        "    async def reset(self, row, seed):\n"
        "        return ''\n"
        "    async def step(self, action):\n"
        "        return EnvStep('', done=True)\n"
        "def plain(clock):\n"
        "    return E(clock)\n"
        "def keywords(clock, max_turns, latency_s):\n"
        "    e = E(clock, max_turns=max_turns, latency_s=latency_s)\n"
        "    e.max_turns = max_turns\n"
        "    return e\n"
        "def anything(clock, **kw):\n"
        "    return E(clock, **kw)\n"
        "def wrong(clock):\n"
        "    return object()\n"
        "def no_clock():\n"
        "    return E(None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from asyncflow.clock import RealClock

    clock = RealClock()
    env = make_env_factory("fac_envs:plain", max_turns=2)(clock)
    assert env.max_turns == 2 and env.kw == {}  # type: ignore[attr-defined]  # rollout.max_turns holds
    env = make_env_factory("fac_envs:keywords", max_turns=3, latency_s=0.5)(clock)
    assert env.max_turns == 3 and env.kw == {"max_turns": 3, "latency_s": 0.5}  # type: ignore[attr-defined]
    env = make_env_factory("fac_envs:anything", max_turns=5, latency_s=0.25)(clock)
    # rollout.max_turns caps a factory that takes the keyword and ignores it (it played all 9 turns; the
    # token budget of Dr.GRPO's norm_length and the over-long penalty assume the setting's bound)
    assert env.kw == {"max_turns": 5, "latency_s": 0.25} and env.max_turns == 5
    assert make_env_factory("fac_envs:anything", max_turns=12)(clock).max_turns == 9  # (a lower own limit holds)
    with pytest.raises(UserError, match="rollout.env_latency_s.*fac_envs:plain"):
        make_env_factory("fac_envs:plain", latency_s=0.1)
    with pytest.raises(UserError, match="not an asyncflow.envs.Env"):
        make_env_factory("fac_envs:wrong")(clock)
    # (a factory that fails on every episode: one line naming it, where it was a traceback mid-run)
    with pytest.raises(UserError, match=r"^rollout.env: 'fac_envs:no_clock' failed to make an environment: TypeError"):
        make_env_factory("fac_envs:no_clock")(clock)
    with pytest.raises(UserError, match="rollout.env: module 'fac_envs' has no factory 'missing'"):
        make_env_factory("fac_envs:missing")
    with pytest.raises(UserError, match="rollout.env: cannot import module 'no_such_envs'"):
        make_env_factory("no_such_envs:make")
    before = list(sys.path)
    assert make_env_factory(f"{tmp_path}/fac_envs.py:plain", max_turns=2)(clock).max_turns == 2  # a file by path
    assert sys.path == before  # (its folder, like the working directory, never joins sys.path)

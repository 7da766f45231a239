"""The Ray runtime: the store across processes, dead consumers, weight sync through the object store,
and a short end-to-end run. One Ray instance for the whole session (`ray_session`, in conftest.py)."""

from __future__ import annotations

import copy
import json
import re
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asyncflow.engines.base import GenRequest
from asyncflow.errors import WaitTimeout
from asyncflow.transfer_queue import NewSample, QueueClosed

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def _actor_classes_by_value(ray_session):
    """The test-only actor classes below travel by value (the workers cannot import this module)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


class _Producer:
    def put(self, store, n: int, group: int) -> list[int]:
        rng = np.random.default_rng(n)
        samples = [
            NewSample(i // group, group, {"big": rng.random(4096), "small": [i, i + 1], "i": i}) for i in range(n)
        ]
        uids = []
        for k in range(0, n, 8):
            uids += store.put_blocking(samples[k : k + 8], timeout=30)
        store.flush()
        return uids


class _Consumer:
    def __init__(self) -> None:
        self.lease = None

    def take(self, store, stage: str, n: int, lease_s: float | None = None) -> list[int]:
        self.lease = store.take_blocking(stage, n, min_samples=n, timeout=30, lease_s=lease_s, fields_extra=["i"])
        return [s.uid for s in self.lease.samples]

    def sums(self) -> dict[int, float]:
        return {s.fields["i"]: float(np.sum(s.fields["big"])) + sum(s.fields["small"]) for s in self.lease.samples}

    def complete(self, store) -> None:
        store.complete(self.lease, {s.uid: {"score": float(s.fields["i"])} for s in self.lease.samples})


@pytest.mark.parametrize("data_plane", ["object_store", "controller"])
def test_store_moves_exact_data_between_processes(ray_session, data_plane: str) -> None:
    ray = ray_session
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=64, data_plane=data_plane)
    try:
        store.register_stage("score", ["big", "small"], groups=True)
        store.register_stage("train", ["score"], groups=True)
        producer = ray.remote(_Producer).options(num_cpus=0).remote()
        consumer = ray.remote(_Consumer).options(num_cpus=0).remote()
        uids = ray.get(producer.put.remote(store, 32, 4), timeout=60)
        assert sorted(uids) == list(range(min(uids), min(uids) + 32))
        taken = ray.get(consumer.take.remote(store, "score", 16), timeout=60)
        assert len(taken) == 16
        rng = np.random.default_rng(32)
        expected = {i: float(np.sum(rng.random(4096))) + 2 * i + 1 for i in range(32)}
        got = ray.get(consumer.sums.remote(), timeout=60)
        assert got and all(abs(v - expected[i]) < 1e-6 for i, v in got.items())
        ray.get(consumer.complete.remote(store), timeout=60)
        lease = store.take_blocking("train", 16, min_samples=16, timeout=30, fields_extra=["i"])
        assert {s.fields["i"] for s in lease.samples} == set(got)  # only the scored groups are ready
        assert all(s.fields["score"] == float(s.fields["i"]) for s in lease.samples)
        store.ack(lease, remove=True)
        assert store.size() == 16
        assert store.errors() == (0, "")
    finally:
        store.kill()


@pytest.mark.parametrize("data_plane", ["object_store", "controller"])
def test_take_each_gives_each_lease_its_own_rows(ray_session, data_plane: str) -> None:
    """One `take_each` over samples of different puts (blobs): each lease reads its own sample's
    data. With the controller data plane every lease's gathered rows had the same key, and the
    client's merge gave all of them the last lease's rows."""
    import asyncio

    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=64, data_plane=data_plane, inline_max_bytes=0)
    try:
        store.register_stage("s", ["x"])

        async def main() -> dict[int, list[int]]:
            for i in range(4):  # one put, so one blob, per sample
                await store.put([NewSample(i, 1, {"x": np.full(4, i, dtype=np.int64)})])
            await store.flush_async()
            got: dict[int, list[int]] = {}
            while len(got) < 4:
                for lease in await store.take_each("s", 4, timeout=30):
                    (s,) = lease.samples
                    got[s.group_id] = s.fields["x"].tolist()
            return got

        assert asyncio.run(main()) == {i: [i] * 4 for i in range(4)}
    finally:
        store.kill()


def test_updates_ride_with_the_client_s_next_take(ray_session) -> None:
    """Responses written in an event loop are applied by the client's next take, in that call: the
    next stage sees them at once (read-your-writes) and no update call of their own went out; the
    same for an ack and the next metrics read."""
    import asyncio

    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=64)
    try:
        store.register_stage("rollout", ["prompt"])
        store.register_stage("reward", ["response"])

        async def main() -> tuple[list[int], int]:
            await store.put([NewSample(g, 1, {"prompt": g}) for g in range(4)])
            leases = await store.take_each("rollout", 4, timeout=30)
            for lease in leases:
                (s,) = lease.samples
                store.complete(lease, {s.uid: {"response": 10 * s.group_id}})
            # the take below carries the four writes (no 2 ms timer ran: nothing awaited since)
            got = await store.take("reward", 4, min_samples=4, timeout=30)
            store.ack(got, remove=True)  # (carried by the metrics read below, which sees it applied)
            left = (await store.metrics_async())["samples"]
            return sorted(s.fields["response"] for s in got.samples), store._updates.unanswered, left

        responses, sent_alone, left = asyncio.run(main())
        assert responses == [0, 10, 20, 30]
        assert sent_alone == 0 and left == 0
    finally:
        store.kill()


def test_complete_and_take_writes_the_sample_and_leases_the_next_as_in_process(ray_session) -> None:
    """The store protocol's fused call on the Ray client: the one-sample lease's write lands (the
    next stage sees it), the next ready sample is leased, and none is once nothing is ready or the
    store is closed."""
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=8)
    try:
        store.register_stage("rollout", ["prompt"])
        store.register_stage("reward", ["response"])
        store.put_blocking([NewSample(g, 1, {"prompt": g}) for g in range(2)], timeout=10)
        first = store.take_blocking("rollout", 1, timeout=10)
        written, second = store.complete_and_take(first, {"response": "a"}, version=3, stage="rollout")
        assert written and second is not None and second.samples[0].group_id == 1
        written, none = store.complete_and_take(second, {"response": "b"}, version=None, stage="rollout")
        assert written and none is None
        got = store.take_blocking("reward", 2, min_samples=2, timeout=10)
        assert sorted((s.fields["response"], s.version) for s in got.samples) == [("a", 3), ("b", None)]
        store.put_blocking([NewSample(2, 1, {"prompt": 2})], timeout=10)
        third = store.take_blocking("rollout", 1, timeout=10)
        store.put_blocking([NewSample(3, 1, {"prompt": 3})], timeout=10)
        store.close()
        assert store.complete_and_take(third, {"response": "c"}, version=None, stage="rollout")[1] is None
    finally:
        store.kill()


def test_errors_come_out_as_the_store_s_own(ray_session) -> None:
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=8)
    try:
        store.register_stage("s", ["x"])
        with pytest.raises(WaitTimeout, match="stage 's'"):
            store.take_blocking("s", 1, timeout=0.2)
        store.close()
        with pytest.raises(QueueClosed):
            store.take_blocking("s", 1, timeout=5)
    finally:
        store.kill()


def test_a_consumer_actor_killed_while_holding_a_lease_loses_nothing(ray_session) -> None:
    ray = ray_session
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=64, owner_check_s=0.3)
    try:
        store.register_stage("score", ["big"], groups=True)
        producer = ray.remote(_Producer).options(num_cpus=0).remote()
        ray.get(producer.put.remote(store, 16, 4), timeout=60)
        victim = ray.remote(_Consumer).options(num_cpus=0).remote()
        held = ray.get(victim.take.remote(store, "score", 8, 3600.0), timeout=60)  # an hour-long lease
        assert store.in_flight("score") == 8
        ray.kill(victim)
        # the controller notices the dead owner and gives its samples back, long before the lease ends
        lease = store.take_blocking("score", 16, min_samples=16, timeout=30)
        assert set(held) <= {s.uid for s in lease.samples}
        assert store.metrics()["released_from_dead_owners"] == 1
    finally:
        store.kill()


def test_a_consumer_actor_s_lease_that_expires_is_forgotten_by_the_controller(ray_session) -> None:
    ray = ray_session
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=64, owner_check_s=0.3)
    try:
        store.register_stage("score", ["big"], groups=True)
        producer = ray.remote(_Producer).options(num_cpus=0).remote()
        ray.get(producer.put.remote(store, 8, 4), timeout=60)
        holder = ray.remote(_Consumer).options(num_cpus=0).remote()
        ray.get(holder.take.remote(store, "score", 8, 0.5), timeout=60)  # never acked: it expires
        assert store.metrics()["owned_leases"] == 1
        again = store.take_blocking("score", 8, min_samples=8, timeout=30)  # back after the deadline
        store.ack(again, remove=True)
        for _ in range(50):
            if store.metrics()["owned_leases"] == 0:
                break
            time.sleep(0.1)
        assert store.metrics()["owned_leases"] == 0 and store.metrics()["released_from_dead_owners"] == 0
        ray.kill(holder)
    finally:
        store.kill()


def test_lease_deadline_is_the_backstop(ray_session) -> None:
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=8)
    try:
        store.register_stage("s", ["x"])
        store.put_blocking([NewSample(0, 1, {"x": 1}), NewSample(1, 1, {"x": 2})], timeout=10)
        first = store.take_blocking("s", 2, min_samples=2, timeout=10, lease_s=0.3)
        again = store.take_blocking("s", 2, min_samples=2, timeout=10)
        assert [s.uid for s in again.samples] == [s.uid for s in first.samples]
    finally:
        store.kill()


def test_an_ack_with_remove_of_an_ended_lease_still_removes_its_samples(ray_session) -> None:
    """In process a False ack makes the trainer remove what it trained; on Ray ack answers True before
    the controller runs it, so trained samples of an expired lease stayed, to be trained again."""
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=8)
    try:
        store.register_stage("s", ["x"])
        store.put_blocking([NewSample(0, 1, {"x": 1}), NewSample(1, 1, {"x": 2})], timeout=10)
        lease = store.take_blocking("s", 2, min_samples=2, timeout=10, lease_s=0.2)
        time.sleep(0.6)  # (the lease ends)
        store.ack(lease, remove=True)
        assert store.size() == 0
    finally:
        store.kill()


def test_a_renewed_lease_is_kept_past_its_first_deadline(ray_session) -> None:
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=8)
    try:
        store.register_stage("s", ["x"])
        store.put_blocking([NewSample(0, 1, {"x": 1}), NewSample(1, 1, {"x": 2})], timeout=10)
        held = store.take_blocking("s", 2, min_samples=2, timeout=10, lease_s=0.5)
        store.renew([held], lease_s=60.0)
        store.flush()
        time.sleep(1.0)
        assert store.take_nowait("s", 2) is None
        assert store.metrics()["expired_leases"] == 0.0 and store.errors()[0] == 0
    finally:
        store.kill()


# ---------------------------------------------------------------------------- weight sync on Ray


def _perturbed_state(model) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for k in state:
        if k.endswith("weight") and state[k].dim() == 2:
            state[k] += 0.5 * torch.randn_like(state[k])
    return state


def _slow_rollout_worker(model):
    """The real `RolloutActor` methods over an engine whose decode steps take 10 ms (so a load
    lands mid-request) and that never stops at EOS."""
    from asyncflow.engines.hf import HFEngine
    from asyncflow.runtime.ray_runtime import RolloutActor
    from asyncflow.runtime.ray_weights import WeightPort
    from asyncflow.workflow.context import VersionBoard

    class SlowRolloutActor(RolloutActor):
        def __init__(self, model) -> None:  # noqa: D107 - bypasses the model-folder set-up
            self.index = 0
            self.engine = HFEngine(copy.deepcopy(model), eos_token_id=[], max_batch=16)
            original = self.engine._decode_step

            def slow() -> None:
                time.sleep(0.01)
                original()

            self.engine._decode_step = slow  # type: ignore[method-assign]
            # (rows given as such: nothing to fetch from the feeder)
            self.parts = types.SimpleNamespace(rows=[], rows_from=[], ctx=types.SimpleNamespace(board=VersionBoard()))
            self.connected = None
            self.port = WeightPort(2**16, 60.0)  # small buckets: a version spans several broadcasts

    return SlowRolloutActor


def test_a_cancelled_remote_request_is_cancelled_in_the_actor_too(ray_session, tiny_model) -> None:
    """Cancelling the driver's await of a Ray call does not stop the actor's task: the request
    decoded to its end for nobody, holding a batch slot. `RemoteEngine` now cancels the call."""
    import asyncio
    import time

    ray = ray_session
    from asyncflow.runtime.ray_runtime import RemoteEngine

    actor = ray.remote(_slow_rollout_worker(tiny_model)).options(num_cpus=0, max_concurrency=100).remote(tiny_model)
    engine = RemoteEngine(actor, capacity=16, timeout_s=60)
    ray.get(actor.__ray_ready__.remote(), timeout=120)

    async def scenario() -> tuple[float, float]:
        running = [asyncio.ensure_future(engine.generate(GenRequest(i, [3 + i, 4, 5], 120, 1.0))) for i in range(2)]
        admitted = time.monotonic() + 30  # (a busy CI machine: both requests may take seconds to arrive)
        while time.monotonic() < admitted and (await actor.stats.remote())["load"] != 2:
            await asyncio.sleep(0.01)
        before = (await actor.stats.remote())["load"]
        for task in running:
            task.cancel()
        deadline = time.monotonic() + 0.6  # uncancelled, the two would decode >1.1 s more (120 steps of 10 ms)
        load = before
        while load and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            load = (await actor.stats.remote())["load"]
        return before, load

    try:
        before, after = asyncio.run(scenario())
    finally:
        ray.kill(actor)
    assert before == 2 and after == 0


class _Sender:
    """A trainer's side of the collective weight path, holding one state to publish."""

    def __init__(self, state) -> None:
        from asyncflow.runtime.ray_weights import WeightPort

        self.state, self.port = state, WeightPort(2**16, 60.0)

    def weights_address(self):
        return self.port.address()

    def join_weights(self, host, port, size, epoch, backend) -> None:
        self.port.join(host, port, 0, size, epoch, backend)

    def send_weights(self, version) -> None:
        self.port.send(self.state, version)

    def published(self, version):
        return self.port.published(version)


class _SenderProxy:
    """What `WeightChannel` calls on the trainer (the driver's side; calls return references)."""

    def __init__(self, actor, state_ref) -> None:
        self.actor, self.state_ref = actor, state_ref

    def weights_address(self):
        import ray

        return ray.get(self.actor.weights_address.remote(), timeout=60)

    def join_weights(self, host, port, size, epoch, backend):
        return self.actor.join_weights.remote(host, port, size, epoch, backend)

    def send_weights(self, version):
        return self.actor.send_weights.remote(version)

    def published(self, version):
        return self.actor.published.remote(version)

    def export_ref(self):
        return self.state_ref


@pytest.mark.parametrize("path", ["object_store", "collective"])
@pytest.mark.parametrize("mode", ["swap", "drain", "abort"])
def test_weight_modes_keep_versions_right_on_either_path(ray_session, tiny_model, mode: str, path: str) -> None:
    """`drain | swap | abort` hold the same whether the actor fetched the weights from the object
    store or received them by broadcast (gloo, several buckets) from a sender actor."""
    import asyncio

    ray = ray_session
    from asyncflow.runtime.ray_runtime import RemoteEngine
    from asyncflow.runtime.ray_weights import StoredWeights, WeightChannel

    actor = ray.remote(_slow_rollout_worker(tiny_model)).options(num_cpus=0, max_concurrency=100).remote(tiny_model)
    engine = RemoteEngine(actor, capacity=16, timeout_s=60)
    state = _perturbed_state(tiny_model)
    state_ref = ray.put(state)  # published once; the actor fetches it
    sender = ray.remote(_Sender).options(num_cpus=0).remote(state) if path == "collective" else None
    ray.get(actor.__ray_ready__.remote(), timeout=120)
    channel = WeightChannel(_SenderProxy(sender, state_ref), [engine], "gloo", 60.0, print) if sender else None

    async def scenario():
        # 100 steps of 10 ms: a load published 0.1 s in lands mid-request even on a busy machine
        reqs = [GenRequest(i, [3 + i, 4, 5], 100, 1.0) for i in range(4)]
        running = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        for _ in range(500):  # wait until all four are decoding, then let a few tokens come out
            if (await actor.stats.remote())["load"] == 4:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        publication = channel.publish(1) if channel is not None else StoredWeights(state_ref)
        seconds = await engine.load_weights(publication, 1, mode)
        late = await engine.generate(GenRequest(99, [3, 4, 5], 5, 1.0))
        return await asyncio.gather(*running), late, seconds

    try:
        results, late, seconds = asyncio.run(scenario())
    finally:
        ray.kill(actor)
        if sender is not None:
            ray.kill(sender)
    assert seconds >= 0 and engine.version == 1
    if channel is not None:
        assert (channel.delivered, channel.fallbacks, channel.epoch) == (1, 0, 1)
    for res in results:
        v = res.token_versions
        assert len(res.response_ids) == len(res.behavior_logprobs) == len(v) == 100
        assert v == sorted(v) and v[0] == 0
        if mode == "drain":
            assert set(v) == {0}
        else:
            assert v[-1] == 1
    assert set(late.token_versions) == {1}


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_short_training_run_on_ray(ray_session, arith_dir: Path, tmp_path: Path) -> None:
    """Also the test of examples/arith_ray.yaml (its base config), with a distillation teacher (a
    stage in the driver, over the store controller's client)."""
    from asyncflow.config import load_config
    from asyncflow.runner import train

    example = Path(__file__).resolve().parent.parent / "examples" / "arith_ray.yaml"
    cfg, _ = load_config(example, [ f"model.path={arith_dir}", "train.max_steps=4", "train.batch_size=32", "rollout.n=4",
        "eval.every=2", "eval.size=40", "logging.progress=false", "workflow.weight_update=abort",
        "runtime.rollout_cpus=0.5", "runtime.train_cpus=0.5", f"algorithm.distill.teacher={arith_dir}",
    ])
    out = tmp_path / "run"
    summary = train(cfg, out, progress_enabled=False)
    assert summary["samples"] == 4 * 32
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["policy_version"] for r in steps] == [1, 2, 3, 4]
    assert all(r["weight_sync_s"] > 0 and r["staleness_max"] <= 1 for r in steps)
    assert abs(steps[0]["distill_reverse_kl"]) < 1e-3  # (the teacher is the starting policy)
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 2, 4]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    trained = [s for s in samples if s["status"] == "trained"]
    assert len(trained) == 4 * 32 and len({s["uid"] for s in trained}) == len(trained)
    # no sample both trained and logged otherwise; every row is whole JSON (actors append concurrently)
    others = {s["uid"] for s in samples if s["status"] != "trained"}
    assert not others & {s["uid"] for s in trained}
    trace = json.loads((out / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert {"rollout/0", "reward/0", "trainer", "weight sync", "teacher"} <= names
    assert (out / "final" / "config.json").is_file()
    assert not ray_session.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray_session.util.placement_group_table().values()
    )


def test_workers_a_local_ray_can_never_hold_are_refused_at_once(ray_session, arith_dir: Path, tmp_path: Path) -> None:
    """A GPU asked of a local Ray without one (or STRICT_SPREAD on its one node) waited the placement
    group's 2 minutes before the run stopped; it is now one line before any actor starts."""
    from asyncflow.config import load_config
    from asyncflow.errors import UserError
    from asyncflow.runner import train
    from asyncflow.runtime.ray_placement import check_placeable

    assert ray_session.cluster_resources().get("GPU", 0) == 0
    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "runtime.kind=ray", "runtime.rollout_gpus=1",
                                "runtime.rollout_cpus=0.5", "runtime.train_cpus=0.5", "logging.progress=false"])
    with pytest.raises(UserError, match=r"^runtime.rollout_gpus / runtime.train_gpus: the workers need 1 GPU\(s\) in "
                                        r"all; this Ray has 0 "):
        train(cfg, tmp_path / "run", progress_enabled=False)
    assert not (tmp_path / "run" / "config.yaml").exists()
    assert not ray_session.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray_session.util.placement_group_table().values())
    with pytest.raises(UserError, match=r"^runtime.placement_strategy: STRICT_SPREAD puts each of the 2 worker"):
        check_placeable([{"CPU": 1.0}, {"CPU": 1.0}], "STRICT_SPREAD", {"CPU": 4.0}, nodes=1)
    with pytest.raises(UserError, match=r"^runtime.rollout_cpus / .*: the workers need 3 CPU\(s\) in all; this Ray has 2"):
        check_placeable([{"CPU": 1.5}, {"CPU": 1.5}], "PACK", {"CPU": 2.0}, nodes=1)
    check_placeable([{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}], "SPREAD", {"CPU": 2.0, "GPU": 1.0}, nodes=2)


def _judge_file(tmp_path: Path) -> tuple[Path, Path]:
    """`async_arith.py:judge`, an `async def` reward function that records each call's group size in
    a file named after the calling process; and that folder of files."""
    calls = tmp_path / "calls"
    calls.mkdir()
    judge = tmp_path / "async_arith.py"  # named by its absolute path: loaded as it is in every actor
    judge.write_text(
        "import asyncio, os\n"
        "from asyncflow.tasks.arith import reward_fn\n"
        f"CALLS = {str(calls)!r}\n"
        "async def judge(prompts, completions, answer, **kw):\n"
        "    await asyncio.sleep(0.01)\n"
        "    with open(os.path.join(CALLS, str(os.getpid())), 'a') as f:\n"
        "        f.write(f'{len(completions)}\\n')\n"
        "    return reward_fn(prompts, completions, answer)\n"
    )
    return judge, calls


def _judged_run(model: Path, judge: Path, out: Path, extra: list[str]) -> dict[str, Any]:
    from asyncflow.config import load_config
    from asyncflow.runner import train

    cfg, _ = load_config(None, ["task=arith", f"model.path={model}", "runtime.kind=ray", "train.max_steps=2", "train.batch_size=16",
                                "rollout.n=4", "rollout.max_new_tokens=4", "eval.every=0", "eval.size=8",
                                "logging.progress=false", f"reward.fn={judge}:judge", *extra])
    summary = train(cfg, out, progress_enabled=False)
    assert summary["samples"] == 2 * 16
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    trained = [s for s in samples if s["status"] == "trained"]
    assert len(trained) == 32 and all(s["reward"] in (0.0, 1.0) for s in trained)
    return summary


@pytest.mark.slow
def test_async_reward_function_runs_in_the_reward_actor(ray_session, arith_dir: Path, tmp_path: Path) -> None:
    """An `async def` reward function on the Ray runtime: awaited in the reward actor's event loop
    (another process), with the driver's evaluation using it too."""
    import os

    judge, calls = _judge_file(tmp_path)
    _judged_run(arith_dir, judge, tmp_path / "run", ["runtime.rollout_cpus=0.5", "runtime.train_cpus=0.5"])
    by_pid = {int(p.name): p.read_text().split() for p in calls.iterdir()}
    actor = [pid for pid in by_pid if pid != os.getpid()]
    assert len(actor) == 1 and set(by_pid[actor[0]]) == {"4"}  # groups of 4, scored in the reward actor
    assert len(by_pid[actor[0]]) >= 8  # at least the 8 trained groups
    driver = by_pid.get(os.getpid(), [])  # the driver's eval calls: one per eval prompt (a group of one)
    assert set(driver) == {"1"} and len(driver) >= 8 and len(driver) % 8 == 0


@pytest.mark.slow
def test_colocated_hub_is_rollout_0_store_feeder_and_reward_in_one_process(ray_session, arith_dir: Path,
                                                                           tmp_path: Path) -> None:
    """`runtime.colocate`: rollout actor 0's process is also the store, the feeder and the reward
    worker (the reward calls come from it); rollout actor 1 is a process of its own that takes its
    prompts from the hub's store; both engines generate what trains."""
    import os

    judge, calls = _judge_file(tmp_path)
    out = tmp_path / "run"
    summary = _judged_run(arith_dir, judge, out, ["runtime.colocate=true", "rollout.workers=2", "runtime.rollout_cpus=0.5",
                                       "runtime.train_cpus=0.5", "rollout.max_batch=4"])
    pids = {(a["role"], a["index"]): a["pid"] for a in summary["actors"]}
    hub = pids[("rollout", 0)]
    assert sorted(pids) == [("rollout", 0), ("rollout", 1), ("trainer", 0)]  # one entry per actor
    assert [a.get("hosts") for a in summary["actors"]] == [["store", "feeder", "reward/0"], None, None]
    assert pids[("rollout", 1)] not in (hub, None)
    by_pid = {int(p.name): p.read_text().split() for p in calls.iterdir()}
    assert set(by_pid[hub]) == {"4"} and len(by_pid[hub]) >= 8  # every group scored in the hub
    assert set(by_pid) <= {hub, os.getpid()}  # (the driver's: its evaluation)
    trace = json.loads((out / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert {"rollout/0", "rollout/1", "reward/0", "trainer"} <= names
    generated = {e["tid"] for e in trace if e.get("name") == "generating"}
    tids = {e["args"]["name"]: e["tid"] for e in trace if e.get("name") == "thread_name"}
    assert {tids["rollout/0"], tids["rollout/1"]} <= generated  # both engines took prompts and generated


def test_columnar_put_lands_row_by_row_in_another_process(ray_session) -> None:
    ray = ray_session
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=64)
    try:
        store.register_stage("score", ["big", "small"], groups=True)
        rng = np.random.default_rng(32)
        big = rng.random((8, 4096))
        uids = store.put_columns_blocking(
            {"big": big, "small": [[i, i + 1] for i in range(8)], "i": list(range(8))}, [0, 0, 0, 0, 1, 1, 1, 1], 4,
            timeout=30,
        )
        assert len(uids) == 8
        consumer = ray.remote(_Consumer).options(num_cpus=0).remote()
        assert len(ray.get(consumer.take.remote(store, "score", 8), timeout=60)) == 8
        got = ray.get(consumer.sums.remote(), timeout=60)
        assert got == {i: pytest.approx(float(big[i].sum()) + 2 * i + 1) for i in range(8)}
        with pytest.raises(ValueError, match="column 'b' has 2 rows"):
            store.put_columns_blocking({"b": [1, 2]}, [0, 1, 2], 1)
    finally:
        store.kill()


class _BadInputActor:
    def __init__(self) -> None:
        from asyncflow.errors import UserError

        raise UserError("reward.fn: cannot import module 'nowhere' (on this node)")

    def ready(self) -> bool:
        return True


def test_bad_input_in_an_actor_constructor_is_one_line_not_an_actor_death(ray_session) -> None:
    """A UserError raised while an actor starts (a reward module missing on a node) reached the driver
    as ActorDiedError: a traceback and exit 1 instead of one line and exit 2."""
    import ray

    from asyncflow.errors import UserError
    from asyncflow.runtime.ray_runtime import _ready

    actor = ray.remote(_BadInputActor).options(num_cpus=0).remote()
    try:
        with pytest.raises(UserError, match=r"^reward.fn: cannot import module 'nowhere' \(on this node\)$"):
            _ready([actor.ready.remote()], ["reward-0"])
    finally:
        ray.kill(actor)


def test_an_unreachable_cluster_address_is_one_line_not_minutes_of_retries() -> None:
    from asyncflow.errors import UserError
    from asyncflow.runtime.ray_init import check_reachable

    with pytest.raises(UserError, match=r"^runtime.address: cannot reach 127.0.0.1:1 \("):
        check_reachable("127.0.0.1:1", timeout_s=5)
    with pytest.raises(UserError, match="cannot reach ray://127.0.0.1:1"):
        check_reachable("ray://127.0.0.1:1", timeout_s=5)
    check_reachable("auto")  # (forms Ray resolves itself are left to it)


def test_a_web_server_given_as_the_cluster_address_is_one_line_not_minutes_of_retries(tmp_path: Path) -> None:
    """The dashboard's port (:8265, what `ray job submit` takes) accepts connections, so ray.init
    retried it for minutes; a Ray GCS answers an HTTP/1 request with HTTP/2 frames, a web server with
    `HTTP/1.x`. Malformed addresses were a ValueError traceback from inside Ray."""
    import http.server
    import threading

    from asyncflow.config import load_config
    from asyncflow.errors import UserError
    from asyncflow.runtime.ray_init import check_reachable

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(UserError, match=r"^runtime.address: 127.0.0.1:\d+ answers as a web server"):
            check_reachable(f"127.0.0.1:{server.server_address[1]}", timeout_s=5)
    finally:
        server.shutdown()
    for address, needle in [("foo", "expected auto, HOST:PORT or ray://HOST:PORT, got 'foo'"),
                            ("host:99999", "got 'host:99999'"),
                            ("http://127.0.0.1:8265", "is a web address")]:
        with pytest.raises(UserError, match=f"^runtime.address: .*{re.escape(needle)}"):
            load_config(None, ["task=arith", "runtime.kind=ray", f"runtime.address={address}"])
    for good in ("auto", "10.0.0.1:6379", "ray://head:10001", "[::1]:6379"):
        load_config(None, ["task=arith", "runtime.kind=ray", f"runtime.address={good}"])


class _BigWriter:
    """Takes rollout leases and completes them with responses large enough for the object store."""

    def __init__(self, store) -> None:  # type: ignore[no-untyped-def]
        self.store = store

    async def work(self, n: int) -> int:
        leases = await self.store.take_each("rollout", n, timeout=30)
        for lease in leases:
            uid = lease.samples[0].uid
            self.store.complete(lease, {uid: {"response_ids": list(range(1024)), "token_versions": [0] * 1024,
                                              "behavior_logprobs": np.zeros(1024, np.float32),
                                              "finish_reason": "length"}})
        await self.store.flush_async()
        return len(leases)

    def pid(self) -> int:
        import os

        return os.getpid()


def test_responses_whose_writer_died_are_marked_cancelled_not_lost_with_it(ray_session) -> None:
    """A response over 16 KiB goes into the object store from the rollout actor's own process, which
    owns it: when that process died (Ray restarting the actor), the next take failed with
    OwnerDiedError and the run ended. Now a reader that finds it gone, or the supervisor once it has
    seen the restart (`release_owner`), marks those samples `cancelled` with empty responses: their
    groups are dropped and refilled."""
    import os

    import ray

    from asyncflow.runtime.ray_errors import actor_id
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=64, owner_check_s=60.0)
    store.register_stage("rollout", ["prompt_ids"])
    store.register_stage("train", ["response_ids"], groups=True)
    store.put_blocking([NewSample(g, 2, {"prompt_ids": [1, 2, 3]}) for g in range(2) for _ in range(2)], timeout=10)
    store.flush()
    writer = ray.remote(_BigWriter).options(num_cpus=0, max_restarts=1).remote(store)
    try:
        assert ray.get(writer.work.remote(4), timeout=60) == 4
        assert store.metrics()["blobs"] >= 1  # (the responses went into the object store)
        pid = ray.get(writer.pid.remote(), timeout=30)
        os.kill(pid, 9)
        deadline = time.monotonic() + 60
        while True:  # Ray restarts it; the supervisor then returns its leases and, now, its lost results
            try:
                if ray.get(writer.pid.remote(), timeout=10) != pid:
                    break
            except ray.exceptions.RayActorError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        # a reader that gets there before the supervisor (the restart takes seconds: a model load)
        lease = store.take_blocking("train", 4, min_samples=4, timeout=10, fields_extra=["finish_reason"])
        assert sorted(len(s.fields["response_ids"]) for s in lease.samples) == [0, 0, 0, 0]
        assert {s.fields["finish_reason"] for s in lease.samples} == {"cancelled"}
        store.release(lease)
        store.release_owner(actor_id(writer))  # (the supervisor, once the new process answers)
        lease = store.take_blocking("train", 4, min_samples=4, timeout=10, fields_extra=["finish_reason"])
        assert {s.fields["finish_reason"] for s in lease.samples} == {"cancelled"}
        assert store.metrics()["lost_with_dead_writer"] == 4.0 and store.metrics()["blobs"] == 0
    finally:
        ray.kill(writer)
        store.close()


class _ColumnConsumer:
    def take_columns(self, store, sizes: list[int]) -> tuple[list[list[int]], list[int], list[float]]:
        """Takes one after another on one client: the later ones read objects it holds (no refs)."""
        lengths, idx, sums = [], [], []
        for n in sizes:
            got = store.take_columns_blocking("train", n, min_samples=n, timeout=30, fields_extra=["i"])
            store.ack(got.lease, remove=True)
            lengths.append([len(b["i"]) for b in got.blocks])
            idx += got.column("i").tolist()
            sums += got.column("big").sum(axis=1).tolist()
        store.flush()  # (an ack waits up to 2 ms for a next take to carry it: applied before returning)
        return lengths, idx, sums

    def take_rows(self, store, n: int) -> dict[int, float]:
        lease = store.take_blocking("train", n, min_samples=n, timeout=30, fields_extra=["i"])
        store.ack(lease, remove=True)
        store.flush()
        return {int(s.fields["i"]): float(np.sum(s.fields["big"])) for s in lease.samples}


def test_coalesced_columnar_puts_read_back_as_columns_rows_and_state(ray_session) -> None:
    """Columnar puts made together share one object (`put_buffer`): a columnar take gets slices of
    it, a per-sample take and `state_dict` the same values row by row."""
    ray = ray_session
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=64)
    try:
        store.register_stage("train", ["big"])
        store._puts.coalesce_s = 30.0  # (all three in one object, sent by the flush below, not the timer)
        big = np.random.default_rng(5).random((24, 4096))
        for start in range(0, 24, 8):
            store.put_columns_blocking({"big": big[start:start + 8], "i": np.arange(start, start + 8)},
                                       list(range(start, start + 8)), 1, timeout=30)
        store.flush()
        consumer = ray.remote(_ColumnConsumer).options(num_cpus=0).remote()
        lengths, idx, sums = ray.get(consumer.take_columns.remote(store, [6, 6]), timeout=60)
        assert lengths == [[6], [2, 4]] and idx == list(range(12))  # a block per put, cut where a take ends
        assert sums == pytest.approx(big[:12].sum(axis=1).tolist())
        rows = ray.get(consumer.take_rows.remote(store, 4), timeout=60)
        assert rows == {i: pytest.approx(float(big[i].sum())) for i in range(12, 16)}
        state = store.state_dict()
        kept = {int(d["fields"]["i"]): d["fields"]["big"] for d in state["samples"]}
        assert sorted(kept) == list(range(16, 24)) and all(np.array_equal(kept[i], big[i]) for i in kept)
        assert store.metrics()["samples"] == 8.0
    finally:
        store.kill()


class _Filler:
    def put(self, store, start: int, n: int) -> list[int]:
        return store.put_blocking([NewSample(i, 1, {"x": i}) for i in range(start, start + n)], timeout=60)


def test_an_ack_carried_by_a_take_that_must_wait_is_applied_first(ray_session) -> None:
    """A plain thread's ack waits for its next take to carry it (`_carried`); when that take must
    wait (here for samples a producer can only put once the ack has made room), the controller
    applies the ack before waiting. An ack no take follows goes out on its own (a timer)."""
    ray = ray_session
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=4)
    try:
        store.register_stage("s", ["x"])
        store.put_blocking([NewSample(i, 1, {"x": i}) for i in range(4)], timeout=30)
        store.flush()
        filler = ray.remote(_Filler).options(num_cpus=0).remote()
        more = filler.put.remote(store, 4, 4)  # waits for room: the store is full
        first = store.take_blocking("s", 4, min_samples=4, timeout=30)
        assert store.ack(first, remove=True)
        second = store.take_blocking("s", 4, min_samples=4, timeout=30)
        assert sorted(s.fields["x"] for s in second.samples) == [4, 5, 6, 7]
        assert len(ray.get(more, timeout=60)) == 4
        store.ack(second, remove=True)  # no take follows: the timer sends it
        deadline = time.monotonic() + 30
        while ray.get(store.handle.size.remote(), timeout=30) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ray.get(store.handle.size.remote(), timeout=30) == 0
    finally:
        store.kill()


class _Reader:
    def read(self, store, batch: int, total: int, readahead: int, stop_after: int | None = None) -> dict:
        """Batches read through `iter_columns`, counting the controller calls it made."""
        calls = []
        send = store._send_batches

        def counted(stage, sizes, *args):
            calls.append(list(sizes))
            return send(stage, sizes, *args)

        store._send_batches = counted
        sizes, idx, sums = [], [], []
        for i, got in enumerate(store.iter_columns("train", batch, total, timeout=30, fields_extra=["i"],
                                                   readahead=readahead)):
            sizes.append(len(got.lease.samples))
            idx += got.column("i").tolist()
            sums += got.column("big").sum(axis=1).tolist()
            store.ack(got.lease, remove=True)
            if stop_after is not None and i + 1 == stop_after:
                break
        store.flush()
        return {"sizes": sizes, "idx": idx, "sums": sums, "calls": calls}


def _put_rows(store, big: np.ndarray, start: int, n: int) -> None:
    store.put_columns_blocking({"big": big[start:start + n], "i": np.arange(start, start + n)},
                               list(range(start, start + n)), 1, timeout=30)


def _filled_store(store_cls, rows: int, seed: int) -> tuple[Any, np.ndarray]:
    """A new store (leases of 600 s: none ends by itself in a test) holding `rows` random rows of
    `big`, put 8 at a time, all admitted."""
    store = store_cls.create(capacity=64, lease_timeout_s=600.0)
    store.register_stage("train", ["big"])
    big = np.random.default_rng(seed).random((rows, 2048))
    for start in range(0, rows, 8):
        _put_rows(store, big, start, 8)
    store.flush()
    return store, big


def test_a_reader_reads_ready_batches_ahead_in_few_calls_and_gets_each_sample_once(ray_session) -> None:
    """`iter_columns` asks for up to `readahead` batches a call (all ready here: every call is served
    whole), hands out leases of exactly `batch` samples (the last one what is left), in order."""
    ray = ray_session
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store, big = _filled_store(RayTransferQueue, 40, seed=7)
    try:
        reader = ray.remote(_Reader).options(num_cpus=0).remote()
        got = ray.get(reader.read.remote(store, 6, 40, 3), timeout=60)
        assert got["sizes"] == [6, 6, 6, 6, 6, 6, 4] and got["idx"] == list(range(40))
        assert got["calls"] == [[6, 6, 6], [6, 6, 6], [4]]  # 3 calls for 7 batches
        assert got["sums"] == pytest.approx(big.sum(axis=1).tolist())
        assert store.size() == 0
        with pytest.raises(ValueError, match="readahead >= 0"):
            next(store.iter_columns("train", 6, 40, readahead=-1))
    finally:
        store.kill()


def test_a_reader_that_stops_early_gives_back_the_batches_it_read_ahead(ray_session) -> None:
    """Stopping after the first batch: the leases of the batches read ahead (and of the call in
    flight) are released, so every other sample is ready for the next reader at once."""
    ray = ray_session
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store, _ = _filled_store(RayTransferQueue, 32, seed=8)
    try:
        reader = ray.remote(_Reader).options(num_cpus=0).remote()
        got = ray.get(reader.read.remote(store, 4, 32, 2, 1), timeout=60)
        assert got["sizes"] == [4] and got["idx"] == [0, 1, 2, 3]
        assert got["calls"] == [[4, 4], [4, 4]]  # (the second call was in flight when the reader stopped)
        assert store.ready_count("train") == 28 and store.in_flight("train") == 0
        rest = ray.get(reader.read.remote(store, 8, 28, 0), timeout=60)
        assert rest["idx"] == list(range(4, 32)) and rest["calls"] == []  # readahead=0: plain takes
    finally:
        store.kill()


def test_a_reader_waits_for_batches_a_producer_puts_later(ray_session) -> None:
    """Read ahead while the samples are still coming: a call waits for its first batch only, takes
    what else is ready, and asks again for the rest; nothing is read twice or lost."""
    ray = ray_session
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=64)
    try:
        store.register_stage("train", ["big"])
        big = np.random.default_rng(9).random((24, 1024))
        reader = ray.remote(_Reader).options(num_cpus=0).remote()
        pending = reader.read.remote(store, 4, 24, 4)
        for start in range(0, 24, 4):
            _put_rows(store, big, start, 4)
            store.flush()
            time.sleep(0.05)
        got = ray.get(pending, timeout=60)
        assert got["sizes"] == [4] * 6 and got["idx"] == list(range(24))
        assert got["sums"] == pytest.approx(big.sum(axis=1).tolist())
        assert sum(map(len, got["calls"])) > len(got["calls"])  # (calls asked for several; some were not served)
        assert store.size() == 0
    finally:
        store.kill()


def test_a_reader_that_stops_while_its_read_ahead_waits_for_samples_cancels_it(ray_session) -> None:
    """The call read ahead still waits for samples that are not there when the reader stops: it is
    cancelled, so samples put afterwards are not leased to nobody."""
    ray = ray_session
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    store = RayTransferQueue.create(capacity=64, lease_timeout_s=600.0)
    try:
        store.register_stage("train", ["big"])
        big = np.random.default_rng(10).random((8, 2048))
        _put_rows(store, big, 0, 4)
        store.flush()
        reader = ray.remote(_Reader).options(num_cpus=0).remote()
        got = ray.get(reader.read.remote(store, 4, 8, 1, 1), timeout=60)
        assert got["idx"] == [0, 1, 2, 3] and got["calls"] == [[4], [4]]
        _put_rows(store, big, 4, 4)
        store.flush()
        assert store.ready_count("train") == 4 and store.in_flight("train") == 0
    finally:
        store.kill()

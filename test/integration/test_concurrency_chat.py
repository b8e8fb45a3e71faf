"""vlm_node under concurrent callers, over real DDS.

Each caller thread owns an rclpy node spun by its own SingleThreadedExecutor, so requests from
different threads are in flight at once and the node's callback group decides their order. The
node serves one turn at a time; the checks are that every request is answered, that nothing
deadlocks (turns, end_session and lifecycle transitions meeting), and that what each caller sees is
what the same requests give when sent one by one.
"""
from __future__ import annotations

import random
import threading
import time
import uuid
from dataclasses import dataclass

import pytest

from synflux_ros.tools.harness import call_service, lifecycle_probe, rgb_image
from synflux_ros.srv import Chat, EndSession

from ros_clients import ChatClient, ok

rclpy = pytest.importorskip("rclpy")
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402

TIMEOUT = 60.0
JOIN_TIMEOUT = 240.0
TURNS = 20
MAX_NEW = 6  # short replies keep 20 turns of 8 conversations within the 1024-token context


@dataclass(frozen=True)
class Turn:
    """What a caller sent and what it got back."""
    session: str
    prompt: str
    success: bool
    error: str
    reply: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int

    @property
    def answer(self):
        return (self.success, self.error, self.reply, self.prompt_tokens, self.cached_tokens,
                self.generated_tokens)

    @property
    def conversation(self) -> int:
        """Tokens of the conversation this turn rendered (reused + prefilled)."""
        return self.cached_tokens + self.prompt_tokens

    @property
    def holds(self) -> int:
        """Positions this turn leaves in the session's cache: the conversation and the reply but its
        last token."""
        return self.conversation + self.generated_tokens - 1


class ThreadClient:
    """Chat and end_session clients on a node of their own, spun only by the thread that calls them."""

    def __init__(self, ns: str):
        self.last_diagnostics: dict[str, str] = {}
        self.node = rclpy.create_node(f"concurrent_{uuid.uuid4().hex[:8]}")
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        # With the services' default response depth of 10, on Jazzy (Fast DDS 2.14) a caller among eight in one
        # process lost its response now and then although the node had served and sent it (3 runs in 7); with
        # depth 100, 5 runs in 5 passed. The clients' readers seem to receive one another's responses and keep
        # only the last `depth` (docs/ros-interfaces.md, vlm_node).
        qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        self.chat_cli = self.node.create_client(Chat, f"{ns}/chat", qos_profile=qos)
        self.end_cli = self.node.create_client(EndSession, f"{ns}/end_session", qos_profile=qos)
        for cli in (self.chat_cli, self.end_cli):
            assert cli.wait_for_service(timeout_sec=TIMEOUT), f"{cli.srv_name} not available"

    def _call(self, cli, request):
        future = cli.call_async(request)
        self.executor.spin_until_future_complete(future, timeout_sec=TIMEOUT)
        if not future.done():
            raise TimeoutError(f"{cli.srv_name} did not answer within {TIMEOUT} s")
        return future.result()

    def chat(self, session: str, prompt: str, **kw) -> Turn:
        r = self._call(self.chat_cli, Chat.Request(session_id=session, prompt=prompt, **kw))
        return Turn(session, prompt, r.success, r.error, r.reply, r.prompt_tokens, r.cached_tokens,
                    r.generated_tokens)

    def end(self, session: str):
        return self._call(self.end_cli, EndSession.Request(session_id=session))

    def diagnostics(self, status_prefix: str, predicate, timeout: float = 10.0) -> bool:
        """Spin until a /diagnostics status whose name starts with ``status_prefix`` satisfies
        ``predicate(values)``; the values seen last are kept in ``last_diagnostics``."""
        matched = threading.Event()

        def on_array(msg):
            for st in msg.status:
                if st.name.startswith(status_prefix):
                    self.last_diagnostics = {kv.key: kv.value for kv in st.values}
                    if predicate(self.last_diagnostics):
                        matched.set()
        sub = self.node.create_subscription(DiagnosticArray, "/diagnostics", on_array, 10)
        try:
            deadline = time.monotonic() + timeout
            while not matched.is_set() and time.monotonic() < deadline:
                self.executor.spin_once(timeout_sec=0.05)
            return matched.is_set()
        finally:
            self.node.destroy_subscription(sub)

    def close(self):
        self.executor.shutdown()
        self.node.destroy_node()


def run_threads(targets) -> None:
    """Run each callable in its own thread; fail on an exception or on a thread that does not finish."""
    errors = []

    def guarded(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
    threads = [threading.Thread(target=guarded, args=(fn,), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "callers still waiting: the node deadlocked"
    if errors:
        raise errors[0]


def turn_request(caller: int, t: int) -> dict:
    """Turn t of caller k: a prompt of its own, images on two turns, sampling on every third."""
    words = ["red", "cup", "left", "shelf", "door", "blue", "box", "near"]
    kw = dict(prompt=f"{caller}.{t} {words[(caller + t) % 8]} {words[(3 * caller + t) % 8]}?",
              max_new_tokens=MAX_NEW, temperature=0.0)
    if t % 3 == 2:
        kw.update(temperature=0.9, top_p=0.95)  # seeded by session id and turn: reproducible
    if t in (0, TURNS // 2):
        kw["images"] = [rgb_image(24 + caller, 32, seq=t)]
    return kw


def check_history(turns: list[Turn]) -> int:
    """Each turn of a conversation reuses what the turn before it left in the cache, from the last fresh
    start (cached_tokens 0) on: at least that turn's whole conversation, at most also its reply (the
    reply is rendered as text again and reused as far as it tokenizes the same). Returns the number of
    fresh starts after the first turn."""
    before, restarts = None, 0
    for i, t in enumerate(turns):
        assert t.success, f"{t.session} turn {i}: {t.error}"
        if i and t.cached_tokens == 0:
            restarts, before = restarts + 1, None
        if before is None:
            assert t.cached_tokens == 0, f"{t.session} turn {i}: cached {t.cached_tokens} at a fresh start"
        else:
            assert before.conversation <= t.cached_tokens <= before.holds, \
                f"{t.session} turn {i}: cached {t.cached_tokens}, the turn before left {before.conversation}.." \
                f"{before.holds}"
        before = t
    return restarts


@pytest.fixture()
def callers(ros_env):
    made = []

    def _make(ns: str, n: int) -> list[ThreadClient]:
        new = [ThreadClient(ns) for _ in range(n)]
        made.extend(new)
        return new
    yield _make
    for c in made:
        c.close()


def test_eight_callers_get_the_transcripts_of_their_conversations_alone(start_node, make_config, callers):
    cfg = make_config("vlm_demo.yaml", session={"max_sessions": 8, "eviction": "refuse"})
    start_node("vlm_node", {"config": cfg}, namespace="/conc8")
    referee, *clients = callers("/conc8", 9)  # the reference has a client of its own
    sessions = [f"caller-{k}" for k in range(8)]

    # reference: each conversation alone, then its session ended so that its slot is free again
    reference = []
    for k, sid in enumerate(sessions):
        reference.append([referee.chat(sid, **turn_request(k, t)) for t in range(TURNS)])
        assert referee.end(sid).success
    for turns in reference:
        assert check_history(turns) == 0

    transcripts: list[list[Turn]] = [[] for _ in sessions]
    waits: list[tuple[float, float, int]] = []  # (sent, answered, caller)

    def converse(k):
        for t in range(TURNS):
            sent = time.monotonic()
            transcripts[k].append(clients[k].chat(sessions[k], **turn_request(k, t)))
            waits.append((sent, time.monotonic(), k))
    start = time.monotonic()
    run_threads([lambda k=k: converse(k) for k in range(8)])
    elapsed = time.monotonic() - start
    for k in range(8):
        assert [t.answer for t in transcripts[k]] == [t.answer for t in reference[k]], f"caller {k} differs"
    # the callers did wait on the node at the same time
    waits.sort()
    overlapping = sum(1 for a, b in zip(waits, waits[1:]) if b[0] < a[1] and b[2] != a[2])
    assert overlapping >= TURNS, overlapping
    print(f"8 callers x {TURNS} turns concurrently: {elapsed:.2f} s, {overlapping} overlapping requests")


def test_two_callers_on_one_session_are_served_in_turn(start_node, callers):
    start_node("vlm_node", {"config": "vlm_demo.yaml"}, namespace="/same")
    a, b = callers("/same", 2)
    n = 10
    seen: list[Turn] = []
    lock = threading.Lock()

    def caller(client, name):
        for t in range(n):
            kw = dict(max_new_tokens=MAX_NEW, temperature=0.8 if t % 2 else 0.0)
            turn = client.chat("shared", f"{name} says {t}", **kw)
            with lock:
                seen.append(turn)
    run_threads([lambda: caller(a, "anna"), lambda: caller(b, "bert")])

    assert len(seen) == 2 * n and all(t.success for t in seen), [t.error for t in seen if not t.success]
    # The node's order is the order of the cache: each turn starts where the one before it ended.
    order = sorted(seen, key=lambda t: t.cached_tokens)
    assert check_history(order) == 0
    last = a.chat("shared", "and now?", max_new_tokens=MAX_NEW, temperature=0.0)
    assert last.success and order[-1].conversation <= last.cached_tokens <= order[-1].holds
    # the node counted each turn once and holds one session
    assert a.diagnostics("/same/vlm_node:", lambda d: d["turns_served"] == str(2 * n + 1)), a.last_diagnostics
    assert a.last_diagnostics["sessions_open"] == "1" and a.last_diagnostics["requests_refused"] == "0"

    # The same prompts in the node's order, one by one on a fresh session of the same id, give the
    # same answers (sampled turns included: their seeds are the session id and the turn number).
    assert a.end("shared").success
    for t in order:
        again = a.chat("shared", t.prompt, max_new_tokens=MAX_NEW,
                       temperature=0.8 if t.prompt.endswith(tuple("13579")) else 0.0)
        assert again.answer == t.answer, t.prompt


def test_end_session_meets_turns_without_deadlock(start_node, make_config, callers):
    cfg = make_config("vlm_demo.yaml", session={"max_sessions": 4, "eviction": "refuse"})
    start_node("vlm_node", {"config": cfg}, namespace="/ending")
    chatters = callers("/ending", 3)
    ender, stranger = callers("/ending", 2)
    sessions = [f"s{k}" for k in range(3)]
    turns: dict[str, list[Turn]] = {s: [] for s in sessions}
    ended = {s: 0 for s in sessions}
    refusals: list[str] = []
    done = threading.Event()

    def chat(k):
        for t in range(12):
            turns[sessions[k]].append(chatters[k].chat(sessions[k], f"step {t} of {k}", max_new_tokens=4,
                                                       temperature=0.0))

    def end_randomly():
        rng = random.Random(7)
        while not done.is_set():
            sid = rng.choice(sessions)
            r = ender.end(sid)
            if r.success:
                ended[sid] += 1
            else:
                refusals.append(r.error)
            time.sleep(rng.uniform(0.0, 0.03))

    def end_unknown():
        for i in range(30):
            r = stranger.end(f"never-{i}")
            assert not r.success and f"unknown session 'never-{i}'" in r.error

    def chatting():
        try:
            run_threads([lambda k=k: chat(k) for k in range(3)])
        finally:
            done.set()
    run_threads([chatting, end_randomly, end_unknown])

    assert all(f"unknown session '" in e for e in refusals), refusals
    assert sum(ended.values()) > 0, "no end_session landed between turns"
    for sid in sessions:
        turns[sid].append(chatters[0].chat(sid, "final", max_new_tokens=4, temperature=0.0))
        # every successful end made the next turn start afresh, and nothing else did
        assert check_history(turns[sid]) == ended[sid], sid
        # a sequential replay with a reset at each fresh start gives the same answers
        r = chatters[0].end(sid)
        assert r.success, r.error
        for i, t in enumerate(turns[sid]):
            again = chatters[0].chat(sid, t.prompt, max_new_tokens=4, temperature=0.0,
                                     reset=i > 0 and t.cached_tokens == 0)
            assert again.answer == t.answer, (sid, i)


def test_eviction_under_pressure_matches_a_sequential_replay(start_node, make_config, callers):
    cfg = make_config("vlm_demo.yaml", session={"max_sessions": 2, "eviction": "lru"})
    start_node("vlm_node", {"config": cfg}, namespace="/pressure")
    n_sessions, rounds = 6, 4
    clients = callers("/pressure", n_sessions)
    sessions = [f"p{k}" for k in range(n_sessions)]
    transcripts: list[list[Turn]] = [[] for _ in sessions]
    barrier = threading.Barrier(n_sessions, timeout=TIMEOUT)

    def request(k, t):
        return dict(prompt=f"round {t} for {k}", max_new_tokens=MAX_NEW, temperature=0.7 if t % 2 else 0.0)

    def converse(k):
        for t in range(rounds):
            transcripts[k].append(clients[k].chat(sessions[k], **request(k, t)))
            barrier.wait()  # all six sessions take a turn each round
    run_threads([lambda k=k: converse(k) for k in range(n_sessions)])

    # Six sessions in two slots: in each round after the first, at most the two sessions used last can
    # still hold their cache, so at least four turns per round start afresh.
    restarts = sum(check_history(t) for t in transcripts)
    assert restarts >= (n_sessions - 2) * (rounds - 1), restarts
    replay = clients[0]
    for k, sid in enumerate(sessions):
        replay.end(sid)  # the session may hold a slot or may have been evicted
        for t, turn in enumerate(transcripts[k]):
            again = replay.chat(sid, reset=t > 0 and turn.cached_tokens == 0, **request(k, t))
            assert again.answer == turn.answer, (sid, t)


def test_cleanup_waits_for_the_turn_in_flight(start_node, make_config, client):
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState
    # 40 ms per decode step: a 30-token reply takes over a second
    cfg = make_config("vlm_demo.yaml", executor={"backend": "mock", "latency_ms": {"decode": 40.0}})
    start_node("vlm_node", {"config": cfg}, namespace="/cleanup")
    change = client.create_client(ChangeState, "/cleanup/vlm_node/change_state")

    def transition(tid):
        r = call_service(client, change, ChangeState.Request(transition=Transition(id=tid)), TIMEOUT,
                         probe=lifecycle_probe())
        assert r.success, tid
    (caller,) = [ThreadClient("/cleanup")]
    try:
        assert caller.chat("s", "hello", max_new_tokens=1).success
        long_turn: list[Turn] = []
        chat = threading.Thread(target=lambda: long_turn.append(
            caller.chat("s", "tell me everything", max_new_tokens=30, temperature=0.0)), daemon=True)
        chat.start()
        chat.join(0.4)
        assert chat.is_alive(), "the turn ended before the transitions; make it longer"
        transition(Transition.TRANSITION_DEACTIVATE)
        transition(Transition.TRANSITION_CLEANUP)  # frees the model once the turn is done
        chat.join(TIMEOUT)
        assert long_turn and long_turn[0].success, long_turn and long_turn[0].error
        assert long_turn[0].generated_tokens >= 1
        refused = caller.chat("s", "still there?")
        assert not refused.success and "not active" in refused.error
        transition(Transition.TRANSITION_CONFIGURE)
        transition(Transition.TRANSITION_ACTIVATE)
        again = ChatClient(client, "/cleanup")
        assert ok(again.chat("s", "hello", max_new_tokens=2)).cached_tokens == 0
    finally:
        caller.close()

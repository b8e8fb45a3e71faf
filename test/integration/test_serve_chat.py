"""synflux-serve's chat endpoint as a process: Ray Serve on loopback with 2 replicas of the demo VLM (mock
executor), driven by the ``openai`` Python client: replies equal to vlm_node's, sessions routed to the replica
that holds their KV cache, a replica killed mid-conversation, streaming, refusals."""
from __future__ import annotations

import base64
import io
import json
import os
import signal
import time
import urllib.request

import numpy as np
import pytest
import yaml

from synflux_ros.tools import harness as testing
from synflux_ros.tools.harness import rgb_image

from ros_clients import ChatClient, ok

pytestmark = pytest.mark.serve
openai = pytest.importorskip("openai", reason="the openai client is not installed (make serve-venv)")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (make serve-venv)")
PIL = pytest.importorskip("PIL.Image")
from synflux_ros.tools.serve_process import ServeProcess  # noqa: E402

KEY = "chat-test-key-0123456789"
MODEL = "vlm-demo"


@pytest.fixture(scope="module")
def chat_config(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_chat")
    with open(testing.config_path("vlm_demo.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw.setdefault("session", {})["max_sessions"] = 16
    raw.setdefault("text", {}).update(max_new_tokens=12)
    path = d / "chat.yaml"
    path.write_text(yaml.safe_dump(raw))
    (d / "key").write_text(KEY)
    return str(path), d


@pytest.fixture(scope="module")
def server(chat_config):
    cfg, d = chat_config
    srv = ServeProcess(cfg, ["--replicas", "2", "--num-cpus", "2", "--object-store-mib", "100",
                             "--api-key-file", str(d / "key")], str(d / "serve.log"), key=KEY)
    yield srv
    code = srv.stop()
    assert code == 0, f"synflux-serve exited with {code} on SIGINT:\n{srv.output()}"


def client_for(server, session: str | None = None, key: str = KEY):
    headers = {"x-session-id": session} if session else None
    return openai.OpenAI(base_url=server.url("/v1"), api_key=key, default_headers=headers, max_retries=0,
                         timeout=60)


def data_url(img_msg) -> str:
    buf = io.BytesIO()
    PIL.fromarray(pixels(img_msg)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


TURNS = [dict(prompt="Describe the scene.", image=rgb_image(120, 160, 3)), dict(prompt="What is on the left?"),
         dict(prompt="And now, in one word?", temperature=0.8, top_p=0.9)]


def user_message(turn) -> dict:
    if "image" not in turn:
        return {"role": "user", "content": turn["prompt"]}
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(turn["image"])}},
                                        {"type": "text", "text": turn["prompt"]}]}


def converse(client, turns, system="You are terse.", **extra):
    """The conversation as an OpenAI client holds it; returns the completions."""
    messages, out = [{"role": "system", "content": system}], []
    for turn in turns:
        messages.append(user_message(turn))
        sampling = {k: turn[k] for k in ("temperature", "top_p") if k in turn}
        r = client.chat.completions.create(model=MODEL, messages=messages, **sampling, **extra)
        out.append(r)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return out


def test_the_openai_client_gets_vlm_node_s_replies(server, chat_config, start_node, client):
    start_node("vlm_node", {"config": chat_config[0]}, namespace="/served_ref")
    ref = ChatClient(client, "/served_ref")
    got = converse(client_for(server, "same-as-node"), TURNS)
    for i, (turn, r) in enumerate(zip(TURNS, got)):
        kw = {k: turn[k] for k in ("temperature", "top_p") if k in turn}
        want = ok(ref.chat("same-as-node", turn["prompt"], images=[turn["image"]] if "image" in turn else [],
                           system_prompt="You are terse." if i == 0 else "", **kw))
        assert r.choices[0].message.content == want.reply, f"turn {i}"
        assert r.usage.completion_tokens == want.generated_tokens
        assert r.usage.prompt_tokens == want.prompt_tokens + want.cached_tokens
        assert r.usage.prompt_tokens_details.cached_tokens == want.cached_tokens
        assert (r.usage.prompt_tokens_details.cached_tokens > 0) == (i > 0)
        assert r.model == MODEL and r.choices[0].finish_reason in ("stop", "length")


def test_twelve_sessions_over_two_replicas_reuse_their_caches(server):
    def replica_of(sid):
        req = urllib.request.Request(server.url("/status"), headers={"x-session-id": sid,
                                                                     "Authorization": f"Bearer {KEY}"})
        return json.loads(urllib.request.urlopen(req, timeout=10).read())["replica"]

    # the ring of the consistent hash depends on the replicas' ids: all 12 on one replica has odds of 1 in 2048
    sessions = [f"robot-{k}" for k in range(12)]
    convos = {sid: [{"role": "user", "content": f"hello from {sid}"}] for sid in sessions}
    for turn in range(3):
        for sid in sessions:
            r = client_for(server, sid).chat.completions.create(model=MODEL, messages=convos[sid])
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert (cached > 0) == (turn > 0), (sid, turn, cached)
            convos[sid] += [{"role": "assistant", "content": r.choices[0].message.content},
                            {"role": "user", "content": f"turn {turn + 1}"}]
    replicas = {replica_of(sid) for sid in sessions}
    assert len(replicas) == 2, replicas  # the sessions hash over both replicas
    assert all(replica_of(sid) == replica_of(sid) for sid in sessions[:3])  # a session stays where it is


def pixels(img_msg) -> np.ndarray:
    return np.frombuffer(bytes(img_msg.data), np.uint8).reshape(img_msg.height, img_msg.width, 3)


def test_a_replica_killed_mid_conversation_is_recomputed_and_answers_the_same(server, chat_config):
    """Sampled turns (the sampling is seeded by session and turn); the replica holding the session is killed
    before turn 3: the next replica rebuilds the session from the messages and answers as the uninterrupted
    conversation (the runtime in process, one turn after the other) does."""
    from synflux_ros.core.config import load_config
    from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime
    sampled = [dict(t, temperature=0.9, top_p=0.95) for t in TURNS]
    runtime = VLMRuntime(load_config(chat_config[0]))
    try:
        reference = [runtime.chat(ChatRequest("interrupted", t["prompt"],
                                              [pixels(t["image"])] if "image" in t else [],
                                              temperature=t["temperature"], top_p=t["top_p"],
                                              system="You are terse." if i == 0 else None)).reply
                     for i, t in enumerate(sampled)]
    finally:
        runtime.close()
    c = client_for(server, "interrupted")
    messages = [{"role": "system", "content": "You are terse."}]
    for i, turn in enumerate(sampled):
        if i == 2:  # kill the replica holding the session; Ray replaces it
            req = urllib.request.Request(server.url("/status"), headers={"x-session-id": "interrupted",
                                                                         "Authorization": f"Bearer {KEY}"})
            pid = int(json.loads(urllib.request.urlopen(req, timeout=10).read())["replica"].rsplit(":", 1)[1])
            os.kill(pid, signal.SIGKILL)
        messages.append(user_message(turn))
        deadline = time.monotonic() + 90
        while True:  # requests routed to the dead replica fail until Ray notices; the client tries again
            try:
                r = c.chat.completions.create(model=MODEL, messages=messages, temperature=turn["temperature"],
                                              top_p=turn["top_p"])
                break
            except (openai.InternalServerError, openai.APIConnectionError, openai.APITimeoutError):
                assert time.monotonic() < deadline, "no replica answered within 90 s of the kill"
                time.sleep(1)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert (cached == 0) if i in (0, 2) else (cached > 0), (i, cached)  # turn 3 recomputed from the messages
        assert r.choices[0].message.content == reference[i], f"turn {i}"


def test_streaming_gives_the_same_reply_and_the_usage(server):
    c = client_for(server, "streamed")
    messages = [{"role": "user", "content": "Tell me about the scene."}]
    plain = client_for(server, "plain").chat.completions.create(model=MODEL, messages=messages)
    stream = c.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                       stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == plain.choices[0].message.content
    assert len([p for p in pieces if p]) > 1  # delivered in pieces, as generated
    assert finish == plain.choices[0].finish_reason
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_models_lists_the_served_model_and_a_bad_key_is_refused(server):
    assert [m.id for m in client_for(server).models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        client_for(server, key="wrong-key-0123456789").models.list()
    with pytest.raises(openai.AuthenticationError):
        client_for(server, key="wrong-key-0123456789").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("kwargs,needle", [
    (dict(messages=[]), "messages: expected a non-empty list"),
    (dict(messages=[{"role": "assistant", "content": "hi"}]), "the last message must be the user's"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "'tool' is not taken"),
    (dict(messages=[{"role": "user", "content": "hi"}], stop=["\n"]), "stop: not supported"),
    (dict(messages=[{"role": "user", "content": "hi"}], n=2), "n: 2 choices asked for"),
    (dict(messages=[{"role": "user", "content": "hi"}], temperature=3), "temperature: 3.0 is out of range"),
    (dict(messages=[{"role": "user", "content": "hi"}], max_tokens=0), "max_new_tokens 0 is out of range"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://example.com/a.png"}}, {"type": "text", "text": "what?"}]}]), "only data: URLs are taken"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "what?"}]}]), "image_url"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]),
     "a system message is taken only as the first message"),
    (dict(messages=[{"role": "user", "content": "<|im_start|>hi"}]), "special token"),
    (dict(messages=[{"role": "user", "content": "x" * 70000}]), "over the limit"),
])
def test_a_bad_request_is_refused_with_the_reason_and_the_server_keeps_serving(server, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as err:
        client_for(server).chat.completions.create(model=MODEL, **kwargs)
    assert needle in err.value.body["message"], err.value.body
    r = client_for(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content is not None


def test_an_unknown_model_is_not_found(server):
    with pytest.raises(openai.NotFoundError, match="this server serves 'vlm-demo'"):
        client_for(server).chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------------------------------- vlm_node, remote
def remote_config(chat_config, server, tmp_path, name: str, **remote) -> str:
    """The chat config with executor.backend remote at ``server`` (its key, raw images) as ``name``."""
    src, d = chat_config
    raw = yaml.safe_load(open(src, encoding="utf-8"))
    raw["executor"] = {"backend": "remote"}
    raw["remote"] = {"url": server.url("/v1") if server else "", "api_key_file": str(d / "key"),
                     "compression": "raw", "connect_timeout": 2.0, **remote}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def node_diagnostics(client, ns: str, predicate, timeout=20.0) -> dict:
    from diagnostic_msgs.msg import DiagnosticArray
    from synflux_ros.tools.harness import spin_until
    seen = []
    sub = client.create_subscription(DiagnosticArray, "/diagnostics", lambda m: seen.extend(
        {kv.key: kv.value for kv in st.values} for st in m.status if st.name.startswith(f"{ns}/vlm_node:")), 10)
    try:
        assert spin_until(client, lambda: any(predicate(d) for d in seen), timeout), seen[-1:]
        return [d for d in seen if predicate(d)][-1]
    finally:
        client.destroy_subscription(sub)


def test_vlm_node_on_the_served_model_answers_as_a_local_vlm_node(server, chat_config, start_node, client,
                                                                   tmp_path):
    """The Chat service of a vlm_node with executor.backend remote, turn by turn against a local vlm_node on
    the same config: the same replies and token counts; from turn 2 the server's replica reuses the session's
    cache; network time is a diagnostics value of its own."""
    remote = remote_config(chat_config, server, tmp_path, "remote.yaml")
    start_node("vlm_node", {"config": chat_config[0]}, namespace="/chat_local")
    start_node("vlm_node", {"config": remote, "diagnostics_period": 0.2}, namespace="/chat_remote")
    local, far = ChatClient(client, "/chat_local"), ChatClient(client, "/chat_remote")
    for i, turn in enumerate(TURNS):
        kw = {k: turn[k] for k in ("temperature", "top_p") if k in turn}
        kw.update(images=[turn["image"]] if "image" in turn else [], system_prompt="You are terse." if i == 0 else "")
        want, got = ok(local.chat("remote-1", turn["prompt"], **kw)), ok(far.chat("remote-1", turn["prompt"], **kw))
        assert got.reply == want.reply, f"turn {i}"
        assert (got.prompt_tokens, got.cached_tokens, got.generated_tokens) == \
            (want.prompt_tokens, want.cached_tokens, want.generated_tokens), f"turn {i}"
        assert (got.cached_tokens > 0) == (i > 0) and got.ttft_ms > 0 and got.total_ms >= got.ttft_ms
    # the session's system prompt holds as a local node's does; end_session ends it
    refused = far.chat("remote-1", "Again", system_prompt="Answer at length.")
    assert not refused.success and "applies when a session starts or resets" in refused.error
    assert ok(far.end("remote-1")).success and not far.end("remote-1").success
    assert ok(far.chat("remote-1", "Hello again")).cached_tokens == 0  # a new conversation
    d = node_diagnostics(client, "/chat_remote", lambda d: int(d["turns_served"]) >= 4)
    assert d["backend"] == "remote" and d["llm_device"] == f"remote {server.url('/v1')}"
    assert float(d["network_median_ms"]) > 0 and d["turns_failed"] == "0" and d["sessions_open"] == "1"


def test_vlm_node_passes_on_the_server_s_refusals_and_keeps_serving(server, chat_config, start_node, client,
                                                                    tmp_path):
    start_node("vlm_node", {"config": remote_config(chat_config, server, tmp_path, "r.yaml")},
               namespace="/chat_refused")
    far = ChatClient(client, "/chat_refused")
    refused = far.chat("r", "<|im_start|>hi")  # the tokenizer's special token: the server's runtime refuses it
    assert not refused.success and "the server refused the turn" in refused.error and \
        "special token" in refused.error, refused.error
    refused = far.chat("r", "x" * 70000)  # over session.max_prompt_bytes: refused before anything is sent
    assert not refused.success and "session.max_prompt_bytes" in refused.error
    refused = far.chat("r", "hi", temperature=3.0)
    assert not refused.success and "temperature" in refused.error, refused.error
    assert ok(far.chat("r", "hi")).generated_tokens > 0
    assert ok(far.chat("r", "and then?")).cached_tokens > 0  # the refusals left the conversation as it was


def test_vlm_node_with_the_server_away_keeps_serving_and_counts_the_failures(chat_config, start_node, client,
                                                                             tmp_path):
    from synflux_ros.tools.serve_process import free_port
    cfg = remote_config(chat_config, None, tmp_path, "away.yaml")
    raw = yaml.safe_load(open(cfg, encoding="utf-8"))
    raw["remote"]["url"] = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    open(cfg, "w", encoding="utf-8").write(yaml.safe_dump(raw))
    start_node("vlm_node", {"config": cfg, "diagnostics_period": 0.2}, namespace="/chat_away")
    far = ChatClient(client, "/chat_away")
    for _ in range(2):
        failed = far.chat("a", "hello")
        assert not failed.success and failed.error.startswith("remote: cannot reach the server at http://127.0.0.1:")
    d = node_diagnostics(client, "/chat_away", lambda d: d["turns_failed"] == "2")
    assert d["turns_served"] == "0" and d["sessions_open"] == "0" and "cannot reach" in d["last_refusal"]


def test_a_remote_config_must_name_the_served_model(server, chat_config, tmp_path):
    from synflux_ros.core.config import ConfigError, load_config
    from synflux_ros.runtimes.remote_chat import RemoteVLMRuntime
    cfg = load_config(remote_config(chat_config, server, tmp_path, "other.yaml")).with_overrides(name="other-model")
    with pytest.raises(ConfigError, match=r"serves \['vlm-demo'\], the config's model is 'other-model'"):
        RemoteVLMRuntime(cfg)

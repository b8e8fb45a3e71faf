"""Chat templates: rendered and tokenized as transformers' apply_chat_template does (token for token, for
several template families and 1..3-turn conversations with system messages); text-only chat models;
the system prompt; cache reuse with templates that rewrite earlier turns; special tokens in user text."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml

from synflux_ros.core.config import ConfigError, from_dict
from synflux_ros.core.contract import graph_set
from synflux_ros.model.chat_template import CHATML, ChatTemplate, find_template, load_chat_template
from synflux_ros.runtimes.sessions import RequestError
from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "..", "config")

# Templates in the style of the model families (written for these tests).
CHATML_DEFAULT_SYSTEM = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful robot assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_STYLE = (
    "{{- bos_token }}{% for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
GEMMA_STYLE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
QWEN3_STYLE = (  # drops the reasoning of earlier replies: the template rewrites earlier turns
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

FAMILIES = {
    "chatml": (CHATML_DEFAULT_SYSTEM, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], {"eos_token": "<|im_end|>"}),
    "llama3": (LLAMA3_STYLE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "gemma": (GEMMA_STYLE, ["<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>"],
              {"bos_token": "<bos>", "eos_token": "<eos>"}),
    "qwen3": (QWEN3_STYLE, ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>",
                            "<|image_pad|>"], {"eos_token": "<|im_end|>"}),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Pick up the red block."}],
    [{"role": "system", "content": "Answer in one short sentence."},
     {"role": "user", "content": "What is on the table?"}],
    [{"role": "system", "content": "You control a robot arm."},
     {"role": "user", "content": "Where is the cup?"},
     {"role": "assistant", "content": "The cup is left of the bowl."},
     {"role": "user", "content": "Move it next to the plate, please."},
     {"role": "assistant", "content": "<think>plan a path</think>\n\nDone: the cup is by the plate."},
     {"role": "user", "content": "Thanks! And the spoon?"}],
]


def checkpoint_dir(tmp_path, family: str):
    """A tokenizer.json (byte-level BPE with the family's special tokens) and a tokenizer_config.json
    with the family's chat template, as a checkpoint ships them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    template, specials, named = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = " ".join(m["content"] for c in CONVERSATIONS for m in c)
    tok.train_from_iterator([text, "system user assistant model"] * 20, trainer)
    d = tmp_path / family
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **named,
                                                         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_token_ids_equal_transformers_apply_chat_template(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    from synflux_ros.model.tokenizer import HFTokenizer
    d = checkpoint_dir(tmp_path, family)
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    ours = HFTokenizer(str(d / "tokenizer.json"), 1000)
    template = load_chat_template(ours.directory)
    assert template.origin.endswith("tokenizer_config.json")
    for convo in CONVERSATIONS:
        for n in range(1, len(convo) + 1):
            if convo[n - 1]["role"] != "user":
                continue
            msgs = convo[:n]
            want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
            got = ours.encode_chat(template.render(msgs))
            assert got == list(want), (family, n)
            assert template.render(msgs) == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def test_where_the_template_comes_from(tmp_path):
    assert find_template("") == ("", "")
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert find_template(str(d))[0] == "D"
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert find_template(str(d))[0] == "J"
    (d / "chat_template.jinja").write_text("K")
    assert find_template(str(d)) == ("K", str(d / "chat_template.jinja"))
    (tmp_path / "mine.jinja").write_text("M")
    assert find_template(str(d), str(tmp_path / "mine.jinja"))[0] == "M"
    with pytest.raises(ConfigError, match="does not exist"):
        find_template(str(d), str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate("{% for %}", "bad.jinja")
    assert ChatTemplate().source == CHATML


def raw(name: str, **sections) -> dict:
    with open(os.path.join(CONFIG, name), encoding="utf-8") as fh:
        d = yaml.safe_load(fh)
    d.update(sections)
    d["executor"] = {"backend": "mock"}
    return d


def test_a_config_without_vision_is_a_text_only_chat_model():
    d = raw("vlm_demo.yaml")
    del d["vision"]
    cfg = from_dict(d)
    assert cfg.vision is None
    assert "vision_encoder" not in {m.name for m in graph_set(cfg)}
    assert from_dict(raw("vlm_demo.yaml", vision=None)).vision is None
    rt = VLMRuntime(cfg)
    r1 = rt.chat(ChatRequest("s", "hello", max_new_tokens=4, temperature=0.0))
    r2 = rt.chat(ChatRequest("s", "and then?", max_new_tokens=4, temperature=0.0))
    assert r1.generated_tokens >= 1 and r2.cached_tokens >= r1.prompt_tokens
    image = np.zeros((32, 32, 3), np.uint8)
    with pytest.raises(RequestError, match="1 images attached, but 'vlm-demo' is a text-only model"):
        rt.chat(ChatRequest("s", "look", images=[image]))
    vla = raw("vla_demo_orin.yaml")
    del vla["vision"]
    with pytest.raises(ConfigError, match="vision: required when mode is 'vla'"):
        from_dict(vla)


def runtime(tmp_path, family: str, **session) -> VLMRuntime:
    d = checkpoint_dir(tmp_path, family)
    cfg = raw("vlm_demo.yaml", tokenizer={"path": str(d / "tokenizer.json")}, vision=None,
              text={"max_new_tokens": 6, "eos_token_ids": []}, session={"max_sessions": 2, **session})
    return VLMRuntime(from_dict(cfg))


@pytest.mark.parametrize("family", ["llama3", "gemma", "qwen3"])
def test_cache_reuse_equals_recompute_with_the_checkpoints_template(tmp_path, family):
    reuse, recompute = runtime(tmp_path, family), runtime(tmp_path / "r", family, reuse_kv_cache=False)
    turns = ["Where is the cup?", "Move it next to the plate.", "And the spoon?"]
    conversation = []
    for i, prompt in enumerate(turns):
        kw = dict(max_new_tokens=5, temperature=0.0, system="You control a robot arm." if i == 0 else None)
        a, b = reuse.chat(ChatRequest("s", prompt, **kw)), recompute.chat(ChatRequest("s", prompt, **kw))
        assert a.token_ids == b.token_ids and a.reply == b.reply, (family, i)
        assert a.cached_tokens + a.prompt_tokens == b.prompt_tokens and b.cached_tokens == 0
        # the conversation as the template renders it, token for token
        conversation += [{"role": "user", "content": prompt}]
        msgs = [{"role": "system", "content": "You control a robot arm."}] + conversation
        expected = reuse.tokenizer.encode_chat(reuse.template.render(msgs))
        assert b.prompt_tokens == len(expected)
        assert reuse.sessions.peek("s").tokens[:len(expected)] == expected
        if i:
            assert a.cached_tokens > 0
        conversation.append({"role": "assistant", "content": a.reply})


def test_a_template_that_rewrites_earlier_turns_still_reuses_their_unchanged_prefix(tmp_path):
    rt = runtime(tmp_path, "qwen3")
    rt.chat(ChatRequest("s", "Where is the cup?", max_new_tokens=3, temperature=0.0))
    session = rt.sessions.peek("s")
    # pretend the model reasoned first: the template drops "<think>...</think>" of earlier replies
    session.messages[-1].text = "<think>look left</think>\n\n" + session.messages[-1].text
    first_turn = len(rt.tokenizer.encode_chat(rt.template.render([{"role": "user", "content": "Where is the cup?"}])))
    r = rt.chat(ChatRequest("s", "Thanks.", max_new_tokens=3, temperature=0.0))
    assert first_turn <= r.cached_tokens


def test_the_system_prompt_starts_a_session_and_stays(tmp_path):
    rt = runtime(tmp_path, "chatml")
    r1 = rt.chat(ChatRequest("s", "Hi", max_new_tokens=2, temperature=0.0, system="Be brief."))
    assert rt.sessions.peek("s").system == "Be brief."
    assert rt.chat(ChatRequest("s", "More", max_new_tokens=2, temperature=0.0, system="Be brief.")).cached_tokens > 0
    with pytest.raises(RequestError, match="system prompt: it applies when a session starts or resets"):
        rt.chat(ChatRequest("s", "More", max_new_tokens=2, system="Be verbose."))
    r = rt.chat(ChatRequest("s", "Hi", max_new_tokens=2, temperature=0.0, system="Be verbose.", reset=True))
    assert r.cached_tokens == 0 and rt.sessions.peek("s").system == "Be verbose."
    # no system prompt: the template's default one is rendered
    other = rt.chat(ChatRequest("t", "Hi", max_new_tokens=2, temperature=0.0))
    assert other.prompt_tokens > r1.prompt_tokens - len(rt.tokenizer.encode("Be brief.")) - 1


@pytest.mark.parametrize("field", ["prompt", "system"])
def test_special_tokens_in_user_text_are_refused(tmp_path, field):
    rt = runtime(tmp_path, "chatml")
    kw = {"prompt": "hi <|im_end|> there"} if field == "prompt" else {"prompt": "hi", "system": "x<|im_start|>"}
    with pytest.raises(RequestError, match=r"contains the special token '<\|im_(end|start)\|>'"):
        rt.chat(ChatRequest("s", **kw))
    assert rt.chat(ChatRequest("s", "hi <im_end> is fine", max_new_tokens=1)).generated_tokens == 1
